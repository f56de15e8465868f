"""The prompt stream shared by the stream benchmarks (specgraph, HF and the vLLM peer): code, chat,
summarisation and math requests, ~20 to ~600 tokens with SmolLM2's chat template. No imports, so
any environment (the vLLM venv too) can read it."""

_CODE = '''import json
import os
from dataclasses import dataclass, field


@dataclass
class Task:
    name: str
    priority: int = 0
    done: bool = False
    tags: list[str] = field(default_factory=list)


class TaskStore:
    def __init__(self, path):
        self.path = path
        self.tasks = {}
        if os.path.exists(path):
            with open(path) as f:
                for row in json.load(f):
                    self.tasks[row["name"]] = Task(**row)

    def add(self, name, priority=0, tags=None):
        if name in self.tasks:
            raise KeyError(f"task {name} exists")
        self.tasks[name] = Task(name, priority, False, list(tags or []))

    def complete(self, name):
        self.tasks[name].done = True

    def pending(self):
        return sorted((t for t in self.tasks.values() if not t.done), key=lambda t: -t.priority)

    def by_tag(self, tag):
        return [t for t in self.tasks.values() if tag in t.tags]

    def save(self):
        rows = [t.__dict__ for t in self.tasks.values()]
        with open(self.path, "w") as f:
            json.dump(rows, f, indent=2)
'''

_REPORT = ("The city council met on Tuesday to review the water department's annual report. The report said "
           "that the average household used 312 litres of water a day, down from 340 the year before, after "
           "the council replaced 4,000 old meters and repaired leaks in the northern district. Spending on "
           "repairs rose by 18 percent, to 2.1 million, while income from water bills fell slightly because "
           "households used less. The department asked for a 5 percent rise in the base charge to cover the "
           "gap, arguing that the new meters would pay for themselves within six years. Two council members "
           "objected, saying that families on low incomes already struggled with bills, and proposed a "
           "reduced rate for the first 100 litres a day instead. The mayor asked the department to return "
           "next month with the cost of both options, and with a plan for the southern district, where "
           "pipes are older and leaks are still common. The report also noted that water quality tests met "
           "every national standard for the fourth year running, and that the reservoir was at 86 percent "
           "of capacity at the end of the summer, its highest level in a decade. ")

PROMPTS = [
    ("chat-short", "Hi! What is a good name for a grey cat?"),
    ("math-short", "What is 17 times 23? Show your working."),
    ("chat", "I'm planning a weekend trip to the mountains in autumn. What should I pack? Give a list."),
    ("code-write", "Write a Python function that checks whether a string is a palindrome, ignoring case and "
                   "punctuation, with a docstring and three examples."),
    ("math", "A shop sells pencils at 3 for 1.20 and pens at 2 for 3.50. How much do 12 pencils and 5 pens cost? "
             "Explain each step."),
    ("explain", "Explain the difference between a list and a tuple in Python, and when to use each."),
    ("code-review", "Review this code and list its bugs and style problems:\n\n" + _CODE),
    ("code-extend", "Add a method `remove(name)` and a method `rename(old, new)` to this class, and show the "
                    "whole class again:\n\n" + _CODE),
    ("summarise", "Summarise this report in five sentences, keeping the numbers:\n\n" + _REPORT),
    ("summarise-long", "Summarise the following two reports, then list what changed between them:\n\n" + _REPORT
     + "\n\nA year later: " + _REPORT.replace("312", "298").replace("18 percent", "9 percent")),
    ("questions", "Read this and answer: how much water did a household use a day, and what did the two council "
                  "members propose?\n\n" + _REPORT),
    ("code-tests", "Write unittest tests for every method of this class:\n\n" + _CODE),
]
