"""`loongsage/Lookup-v0`: multi-hop questions over a small generated company directory.

Each task generates its own directory: about a dozen people (each with a team, an office city
and a manager) and a few offices (each with a country and a floor count). All names are
invented from syllables, so the model cannot know an answer; it has to look it up, and with
`hops` > 1 every lookup depends on the previous result:

    hops=1  "In which city is Talo Brenvik's office?"          get_person
    hops=2  "In which country is Talo Brenvik's office?"       get_person -> get_office
    hops=3  "In which country does Talo Brenvik's manager work?"
                                                 get_person -> get_person -> get_office

The reward is 1.0 when the final message's `Answer:` line names the right city/country
(case and surrounding whitespace ignored), else 0.0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs.base import Task, ToolEnv, extract_answer

_SYLLABLES = ["bra", "ven", "tal", "ori", "mek", "sul", "dra", "kin", "lo", "vas", "ter", "mon",
              "qua", "zel", "fir", "nor", "pel", "ista", "gar", "ul"]  # fmt: skip
_TEAMS = ["billing", "search", "storage", "mobile", "security", "payments", "ads", "infra"]


def _word(rng: np.random.Generator, parts: int) -> str:
    return "".join(_SYLLABLES[i] for i in rng.integers(len(_SYLLABLES), size=parts)).capitalize()


class LookupEnv(ToolEnv):
    """Answer a question about a generated company directory by chaining lookups."""

    answer_format = "End your final answer with a line of the form `Answer: <name>`."
    instructions = "Look facts up with the tools; do not guess."

    def __init__(
        self, *, hops: int = 2, num_people: int = 12, max_turns: int = 6, **kwargs: Any
    ) -> None:
        if hops not in (1, 2, 3):
            raise ValueError(f"hops={hops!r}: pass 1, 2 or 3 (lookups the answer needs)")
        if not isinstance(num_people, int) or num_people < 3:
            raise ValueError(f"num_people={num_people!r}: pass an int >= 3")
        self.hops, self.num_people = hops, num_people
        super().__init__(max_turns=max_turns, **kwargs)

    def tools(self):
        return [self.get_person, self.get_office]

    def get_person(self, name: str) -> dict[str, Any]:
        """Look up an employee in the company directory.

        Args:
            name: The person's full name, e.g. "Talo Brenvik".
        """
        people = self.task.data["people"]
        key = " ".join(name.split()).casefold()
        for person in people:
            if person["name"].casefold() == key:
                return dict(person)
        raise KeyError(f"no person named {name!r} in the directory")

    def get_office(self, city: str) -> dict[str, Any]:
        """Look up one of the company's offices by its city.

        Args:
            city: The office's city, as a person's record names it.
        """
        key = city.strip().casefold()
        for office in self.task.data["offices"]:
            if office["city"].casefold() == key:
                return dict(office)
        raise KeyError(f"no office in {city!r}")

    def sample_task(self, rng: np.random.Generator) -> Task:
        countries = _distinct(rng, 4, lambda: _word(rng, 2) + "ia")
        cities = _distinct(rng, 5, lambda: _word(rng, 2))
        offices = [
            {"city": city, "country": countries[rng.integers(len(countries))],
             "floors": int(rng.integers(1, 40))}
            for city in cities
        ]  # fmt: skip
        names = _distinct(rng, self.num_people, lambda: f"{_word(rng, 2)} {_word(rng, 3)}")
        people = []
        for i, name in enumerate(names):
            # Person 0 is the CEO; everyone else reports to someone earlier in the list.
            manager = names[rng.integers(i)] if i else None
            people.append(
                {"name": name, "team": _TEAMS[rng.integers(len(_TEAMS))],
                 "office": cities[rng.integers(len(cities))], "manager": manager}
            )  # fmt: skip
        by_name = {p["name"]: p for p in people}
        office_of = {o["city"]: o for o in offices}
        subject = people[int(rng.integers(1, len(people)))]  # has a manager
        if self.hops == 1:
            prompt = f"In which city is {subject['name']}'s office?"
            answer = subject["office"]
        elif self.hops == 2:
            prompt = f"In which country is {subject['name']}'s office?"
            answer = office_of[subject["office"]]["country"]
        else:
            manager = by_name[subject["manager"]]
            prompt = f"In which country does {subject['name']}'s manager work?"
            answer = office_of[manager["office"]]["country"]
        prompt += " Put your final answer on its own line as: Answer: <name>"  # see calc.py
        return Task(prompt=prompt, answer=answer, data={"people": people, "offices": offices})

    def score(self, task: Task, final_answer: str) -> float:
        answer = extract_answer(final_answer)
        return float(answer is not None and answer.casefold() == task.answer.casefold())


def _distinct(rng: np.random.Generator, n: int, make) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        word = make()
        if word not in out:
            out.append(word)
    return out
