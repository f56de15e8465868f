"""The structured-output stream of benchmarks/json_bench.py: requests that ask for a JSON answer,
each with the JSON schema the answer must follow (extraction from a given text, classification,
a plan). No imports, so any environment (the vLLM venv too) can read it."""

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "job": {"type": "string"}}, "required": ["name", "age", "city", "job"]}
TASKS = {"type": "object", "properties": {"tasks": {"type": "array", "items": {"type": "object", "properties": {
    "title": {"type": "string"}, "priority": {"enum": ["low", "medium", "high"]},
    "done": {"type": "boolean"}}, "required": ["title", "priority", "done"]}}}, "required": ["tasks"]}
REVIEW = {"type": "object", "properties": {
    "sentiment": {"enum": ["positive", "negative", "mixed"]}, "score": {"type": "integer"},
    "pros": {"type": "array", "items": {"type": "string"}}, "cons": {"type": "array", "items": {"type": "string"}}},
    "required": ["sentiment", "score", "pros", "cons"]}
EVENT = {"type": "object", "properties": {
    "event": {"type": "string"}, "date": {"type": "string"}, "location": {"type": "string"},
    "attendees": {"type": "array", "items": {"type": "string"}}}, "required": ["event", "date", "location", "attendees"]}
PRODUCT = {"type": "object", "properties": {
    "product": {"type": "string"}, "price": {"type": "number"}, "currency": {"type": "string"},
    "in_stock": {"type": "boolean"}, "colors": {"type": "array", "items": {"type": "string"}}},
    "required": ["product", "price", "currency", "in_stock", "colors"]}
RECIPE = {"type": "object", "properties": {
    "dish": {"type": "string"}, "servings": {"type": "integer"},
    "ingredients": {"type": "array", "items": {"type": "string"}}, "minutes": {"type": "integer"}},
    "required": ["dish", "servings", "ingredients", "minutes"]}


def _ask(text: str, what: str) -> str:
    return f"{text}\n\n{what} Answer with JSON only."


JSON_PROMPTS = [  # (name, prompt, schema)
    ("person-1", _ask("Maria Lopez is a 34-year-old architect who lives in Valencia. She designs schools and "
                      "libraries.", "Extract the person's name, age, city and job."), PERSON),
    ("person-2", _ask("Our new colleague, Tom Becker, joined the team last week. Tom is 41, works as a data "
                      "engineer, and moved here from Hamburg.", "Extract the person's name, age, city and job."),
     PERSON),
    ("tasks-1", _ask("Todo for Monday: fix the login bug (urgent, not done), write the release notes (medium, "
                     "done), update the team wiki (low priority, not done).",
                     "List the tasks with title, priority and whether each is done."), TASKS),
    ("tasks-2", _ask("Sprint board: migrate the database - high - in progress; add dark mode - low - finished; "
                     "review the pull requests - medium - finished.",
                     "List the tasks with title, priority and whether each is done."), TASKS),
    ("review-1", _ask("Review: The headphones sound great and the battery lasts two days, but the ear cushions "
                      "get warm and the app crashes sometimes. 7/10.",
                      "Give the sentiment, the score out of 10, the pros and the cons."), REVIEW),
    ("review-2", _ask("I returned this blender. It was loud, the lid leaked and it stopped working after a week. "
                      "The only good thing was the color. 2 out of 10.",
                      "Give the sentiment, the score out of 10, the pros and the cons."), REVIEW),
    ("event-1", _ask("Reminder: the quarterly planning meeting is on March 14 in the Blue Room on the third "
                     "floor. Alice, Bob and Chen will attend.",
                     "Extract the event, its date, its location and the attendees."), EVENT),
    ("event-2", _ask("Join us for Sara's farewell dinner on Friday, June 2, at the Olive Tree restaurant. "
                     "So far Omar, Lena, Priya and Jack have said yes.",
                     "Extract the event, its date, its location and the attendees."), EVENT),
    ("product-1", _ask("The Trailblazer backpack costs 89.99 USD. It is in stock in black, olive and navy.",
                       "Extract the product, price, currency, stock status and colors."), PRODUCT),
    ("product-2", _ask("Sorry, the Aurora desk lamp (49.50 EUR) is currently sold out. It comes in white and "
                       "brass.", "Extract the product, price, currency, stock status and colors."), PRODUCT),
    ("recipe-1", _ask("Pancakes for four: mix 200 g flour, 2 eggs, 300 ml milk and a pinch of salt, rest the "
                      "batter, then fry. Takes about 25 minutes.",
                      "Extract the dish, servings, ingredients and minutes."), RECIPE),
    ("recipe-2", _ask("A quick tomato soup serves two: onions, garlic, canned tomatoes, stock and basil, "
                      "simmered for 20 minutes.", "Extract the dish, servings, ingredients and minutes."),
     RECIPE),
]
