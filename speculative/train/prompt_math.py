"""Math word problems: templates whose blanks (names, objects, numbers, units)
are drawn at random, so one template gives many distinct problems.

A blank is drawn on first use and then fixed for that problem, so derived
blanks stay consistent with the ones they come from (``{km}`` is ``{k}`` times
``{m}``: a total that shares out evenly, a distance that a speed covers in whole
hours). The problems need not have tidy answers, but they must make sense.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

from speculative.train.prompt_topics import items

NAMES = items("""
Aisha; Ben; Carlos; Dana; Elif; Farid; Grace; Hiro; Ines; Jamal; Keiko; Liam; Maya; Nikolai; Olu; Priya; Quentin
Rosa; Sven; Tariq; Uma; Victor; Wen; Ximena; Yusuf; Zoe; Amara; Bruno; Chloe; Dmitri; Esther; Felix; Gita; Hugo
Ivy; Jonas; Kofi; Lena; Mateo; Nadia; Omar; Paula; Rahul; Sofia; Theo; Valentina; William; Yara; Zainab; Mei
""")
THINGS = items("""
apples; stickers; marbles; pencils; cookies; books; stamps; seashells; trading cards; cupcakes; candles; plants
oranges; notebooks; balloons; muffins; postcards; comics; pebbles; beads; tomatoes; lemons; badges; crayons
""")
VEHICLES = items("A train; A bus; A delivery van; A car; A ferry; A motorbike; A coach")
COLOURS = ("red", "green", "blue")
TRIPLES = ((3, 4), (5, 12), (8, 15), (7, 24), (20, 21), (9, 40))
CONVERSIONS = (
    ("hours", "minutes"),
    ("minutes", "seconds"),
    ("metres", "centimetres"),
    ("kilograms", "grams"),
    ("litres", "millilitres"),
    ("feet", "inches"),
    ("pounds", "ounces"),
    ("weeks", "days"),
    ("kilometres", "metres"),
)
FRACTIONS = (
    Fraction(1, 2),
    Fraction(1, 3),
    Fraction(1, 4),
    Fraction(1, 5),
    Fraction(1, 6),
    Fraction(1, 8),
    Fraction(2, 5),
    Fraction(3, 8),
    Fraction(2, 7),
    Fraction(3, 10),
)

Draw = Callable[[random.Random, "Blanks"], object]


def _other(pool: tuple[str, ...], *taken: str) -> Draw:
    """An item of ``pool`` different from the blanks named in ``taken``."""
    return lambda r, b: r.choice([x for x in pool if x not in {b[t] for t in taken}])


def _clock(r: random.Random) -> str:
    return f"{r.randint(1, 11)}:{r.choice(range(0, 60, 5)):02d} {r.choice(('am', 'pm'))}"


def _fractions(r: random.Random) -> tuple[Fraction, Fraction]:
    while True:
        a, b = r.sample(FRACTIONS, 2)
        if a + b < 1:
            return a, b


BLANKS: dict[str, Draw] = {
    "name": lambda r, b: r.choice(NAMES),
    "name2": _other(NAMES, "name"),
    "item": lambda r, b: r.choice(THINGS),
    "item2": _other(THINGS, "item"),
    "vehicle": lambda r, b: r.choice(VEHICLES),
    "cur": lambda r, b: r.choice("$$€£"),
    "a": lambda r, b: r.randint(12, 80),
    "b": lambda r, b: r.randint(3, 40),
    "c": lambda r, b: r.randint(2, b["a"]),
    "less": lambda r, b: b["a"] - 2 * r.randint(1, b["a"] // 2 - 1),
    "k": lambda r, b: r.randint(2, 12),
    "m": lambda r, b: r.randint(3, 25),
    "km": lambda r, b: b["k"] * b["m"],
    "part": lambda r, b: r.randint(1, b["km"] - 1),
    "small": lambda r, b: r.randint(2, 9),
    "small2": lambda r, b: r.randint(2, 9),
    "big": lambda r, b: r.randint(5, 60) * 10,
    "price": lambda r, b: r.randint(1, 40) + r.choice((0, 0.25, 0.5, 0.75, 0.99)),
    "price2": lambda r, b: r.randint(1, 40) + r.choice((0, 0.25, 0.5, 0.75, 0.99)),
    "child_price": lambda r, b: b["price"] * r.choice((0.5, 0.6, 0.75)),
    "note": lambda r, b: next(n for n in (5, 10, 20, 50, 100, 200, 500) if n >= b["small"] * b["price"]),
    "pct": lambda r, b: r.choice((5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 60, 75)),
    "tip": lambda r, b: r.choice((10, 12, 15, 18, 20, 25)),
    "meal": lambda r, b: r.randint(15, 180) + r.choice((0, 0.2, 0.45, 0.8)),
    "pop": lambda r, b: r.randint(20, 900) * 100,
    "years": lambda r, b: r.randint(2, 12),
    "total": lambda r, b: r.choice((20, 40, 60, 80, 100, 120, 200)),
    "score": lambda r, b: r.randint(b["total"] // 3, b["total"]),
    "p1": lambda r, b: r.randint(20, 400),
    "p2": lambda r, b: b["p1"] + r.randint(1, b["p1"]),
    "original": lambda r, b: r.randint(4, 60) * 5,
    "after": lambda r, b: b["original"] * (100 - b["pct"]) / 100,
    "speed": lambda r, b: r.randint(6, 22) * 5,
    "unit": lambda r, b: r.choice(("km", "miles")),
    "hours": lambda r, b: r.randint(2, 9),
    "minutes": lambda r, b: r.randint(5, 55),
    "dist": lambda r, b: b["speed"] * b["hours"],
    "t1": lambda r, b: r.randint(2, 9),
    "t2": lambda r, b: r.randint(2, 12),
    "rate": lambda r, b: r.randint(3, 40),
    "cap": lambda r, b: b["rate"] * r.randint(5, 60),
    "pages": lambda r, b: r.randint(50, 2000),
    "clock": lambda r, b: _clock(r),
    "wage": lambda r, b: r.randint(10, 45) + r.choice((0, 0.5)),
    "days": lambda r, b: r.randint(3, 6),
    "fuel": lambda r, b: r.randint(40, 120) / 10,
    "age": lambda r, b: r.randint(5, 16),
    "gap": lambda r, b: r.randint(20, 38),
    "later": lambda r, b: b["age"] + r.randint(3, 20),
    "diff": lambda r, b: r.randint(2, 15),
    "sum": lambda r, b: 2 * r.randint(10, 40) + b["diff"],
    "length": lambda r, b: r.randint(3, 40),
    "width": lambda r, b: r.randint(2, 30),
    "height": lambda r, b: r.randint(2, 20),
    "lu": lambda r, b: r.choice(("m", "cm", "feet", "metres", "inches")),
    "radius": lambda r, b: r.randint(2, 30),
    "legs": lambda r, b: _scaled(r.choice(TRIPLES), r.randint(1, 5)),
    "tile": lambda r, b: r.choice((20, 25, 30, 40, 50)),
    "side": lambda r, b: r.randint(3, 50),
    "laps": lambda r, b: r.randint(2, 12),
    "conv": lambda r, b: r.choice(CONVERSIONS),
    "n": lambda r, b: r.randint(2, 15),
    "celsius": lambda r, b: r.randint(-15, 40),
    "fahrenheit": lambda r, b: r.randint(0, 104),
    "grams": lambda r, b: r.randint(2, 40) * 25,
    "trail": lambda r, b: r.randint(3, 60),
    "cm": lambda r, b: r.randint(120, 200),
    "ratio": lambda r, b: (r.randint(1, 7), r.randint(1, 7)),
    "mixed": lambda r, b: sum(b["ratio"]) * r.randint(2, 12),
    "scores": lambda r, b: ", ".join(str(r.randint(55, 100)) for _ in range(4)),
    "target": lambda r, b: r.randint(70, 90),
    "numbers": lambda r, b: ", ".join(str(r.randint(1, 50)) for _ in range(r.randint(5, 8))),
    "fracs": lambda r, b: _fractions(r),
    "servings": lambda r, b: r.choice((2, 4, 6, 8)),
    "servings2": lambda r, b: r.choice((3, 5, 10, 12, 15)),
    "cups": lambda r, b: r.choice((1.5, 2, 2.5, 3, 4)),
    "principal": lambda r, b: r.randint(5, 200) * 50,
    "interest": lambda r, b: r.choice((1.5, 2, 2.5, 3, 3.5, 4, 5, 6)),
    "save": lambda r, b: r.randint(5, 40),
    "goal": lambda r, b: b["save"] * r.randint(6, 30),
    "base": lambda r, b: r.randint(10, 35),
    "per_gb": lambda r, b: r.choice((1, 2, 2.5, 3, 5)),
    "bill": lambda r, b: b["base"] + b["per_gb"] * r.randint(1, 15),
    "marbles": lambda r, b: tuple(r.randint(2, 15) for _ in COLOURS),
    "colour": lambda r, b: r.choice(COLOURS),
    "dice": lambda r, b: r.randint(2, 12),
    "people": lambda r, b: r.randint(3, 8),
    "menu": lambda r, b: tuple(r.randint(2, 9) for _ in range(3)),
    "flips": lambda r, b: r.randint(3, 10),
    "heads": lambda r, b: r.randint(2, b["flips"] - 1),
    "group": lambda r, b: r.randint(6, 20),
    "chosen": lambda r, b: r.randint(2, 5),
    "x": lambda r, b: r.randint(-12, 20),
    "rhs": lambda r, b: b["k"] * b["x"] + b["b"],
    "seq": lambda r, b: _sequence(r),
    "riders": lambda r, b: r.randint(40, 400),
    "seats": lambda r, b: r.choice((12, 16, 30, 45, 52)),
}


def _scaled(sides: tuple[int, int], factor: int) -> tuple[int, int]:
    return sides[0] * factor, sides[1] * factor


def _sequence(r: random.Random) -> str:
    start, step = r.randint(1, 20), r.randint(2, 9)
    if r.random() < 0.5:
        return ", ".join(str(start + step * i) for i in range(5))
    return ", ".join(str(start * min(step, 4) ** i) for i in range(5))


TEMPLATES = (
    # arithmetic
    "{name} has {a} {item}. {name2} gives {name} {b} more, and then {name} gives away {c}. "
    "How many {item} does {name} have now?",
    "A box holds {k} rows of {m} {item}. How many {item} are there in {small} boxes?",
    "{name} shares {km} {item} equally among {k} friends. How many does each friend get?",
    "A theatre has {k} rows with {m} seats in each row. If {part} seats are taken, how many are empty?",
    "{name} reads {a} pages on Monday, twice as many on Tuesday and {b} pages on Wednesday. "
    "How many pages does {name} read over the three days?",
    "{name} buys {small} {item} at {cur}{price:.2f} each and pays with a {cur}{note} note. How much change is due?",
    "Concert tickets cost {cur}{price:.2f} for adults and {cur}{child_price:.2f} for children. "
    "What do {small} adults and {small2} children pay altogether?",
    "{name} had {a} {item} and {name2} had {less}. After {name} gave {name2} some, they had the same number. "
    "How many did {name} give away?",
    # percentages
    "A jacket normally costs {cur}{big}. It is on sale for {pct}% off. What is the sale price?",
    "A restaurant bill comes to {cur}{meal:.2f} and {name} wants to tip {tip}%. "
    "How much is the tip, and what is the total?",
    "A town had {pop:,} residents. The population grew by {pct}% over {years} years. How many people live there now?",
    "{name} scored {score} out of {total} on a test. What percentage is that?",
    "The price of a bicycle rose from {cur}{p1} to {cur}{p2}. By what percentage did the price go up?",
    "In a class of {total} students, {pct}% walk to school. How many students walk?",
    "After a {pct}% discount, a pair of shoes costs {cur}{after:.2f}. What was the original price?",
    "{name} spends {pct}% of a {cur}{big} monthly budget on food. How much is left for everything else?",
    # rates
    "{vehicle} travels at {speed} {unit} per hour for {hours} hours. How far does it go?",
    "{name} drives {dist} {unit} in {hours} hours. What is the average speed?",
    "{name} can paint a fence in {t1} hours, and {name2} can paint it in {t2} hours. "
    "How long will it take them working together?",
    "A tap fills a {cap}-litre tank at {rate} litres per minute. How long does it take to fill the tank?",
    "A printer prints {rate} pages per minute. How long will it take to print {pages} pages?",
    "Which is the better deal: {small} {item} for {cur}{price:.2f} or {small2} {item} for {cur}{price2:.2f}? "
    "Use the price per item to explain.",
    "{vehicle} leaves at {clock} and travels {dist} km at {speed} km per hour. At what time does it arrive?",
    "{name} earns {cur}{wage:.2f} an hour and works {hours} hours a day, {days} days a week. "
    "How much does {name} earn in a week?",
    "A car uses {fuel} litres of fuel per 100 km. How much fuel does it need for a {dist}-km trip?",
    # ages
    "{name} is {age} years old and {name}'s mother is {gap} years older. "
    "How old will the mother be when {name} is {later}?",
    "{name} is {diff} years older than {name2}. Together their ages add up to {sum}. How old is each of them?",
    "{name} is three times as old as {name2}. In {years} years, {name} will be twice as old as {name2}. "
    "How old are they now?",
    # geometry
    "A rectangular garden is {length} {lu} long and {width} {lu} wide. "
    "What is its area, and how much fencing goes all the way around it?",
    "What is the area of a circle with a radius of {radius} {lu}? Use 3.14 for pi.",
    "A triangle has a base of {length} {lu} and a height of {width} {lu}. What is its area?",
    "A box measures {length} by {width} by {height} {lu}. What is its volume?",
    "A cylindrical water tank has a radius of {small} m and a height of {height} m. How much water can it hold?",
    "A right triangle has legs of {legs[0]} and {legs[1]} {lu}. How long is the hypotenuse?",
    "A room is {length} m by {width} m. The floor tiles are {tile} cm squares. How many tiles cover the floor?",
    "The perimeter of a square is {side} {lu}. What is its area?",
    "A circular running track has a diameter of {big} m. How far does a runner go in {laps} laps?",
    # unit conversions
    "How many {conv[1]} are there in {n} {conv[0]}?",
    "Convert {celsius} degrees Celsius to Fahrenheit.",
    "Convert {fahrenheit} degrees Fahrenheit to Celsius.",
    "A recipe needs {grams} grams of flour, but {name}'s scale only shows ounces. "
    "About how many ounces is that? (One ounce is about 28.35 grams.)",
    "A hiking trail is {trail} km long. How long is it in miles? (One mile is about 1.609 km.)",
    "{name} is {cm} cm tall. How tall is that in feet and inches?",
    # ratios, averages, fractions
    "The ratio of {item} to {item2} in a box is {ratio[0]}:{ratio[1]}. "
    "If there are {mixed} in total, how many {item} are there?",
    "{name}'s test scores are {scores}. What score on the fifth test gives an average of {target}?",
    "Find the mean, median and range of these numbers: {numbers}.",
    "{name} eats {fracs[0]} of a pizza and {name2} eats {fracs[1]}. What fraction of the pizza is left?",
    "A recipe for {servings} people uses {cups} cups of rice. How much rice is needed for {servings2} people?",
    # money
    "{name} puts {cur}{principal} in a savings account that pays {interest}% simple interest a year. "
    "How much interest is earned after {years} years?",
    "If {cur}{principal} is invested at {interest}% interest compounded yearly, what is it worth after {years} years?",
    "{name} saves {cur}{save} every week. How many weeks until {name} has {cur}{goal} for a new bike?",
    "A phone plan costs {cur}{base} a month plus {cur}{per_gb:.2f} per gigabyte. "
    "{name}'s bill was {cur}{bill:.2f}. How many gigabytes were used?",
    # probability and counting
    "A bag holds {marbles[0]} red, {marbles[1]} green and {marbles[2]} blue marbles. "
    "One is picked at random. What is the probability that it is not {colour}?",
    "Two fair dice are rolled. What is the probability that they add up to {dice}?",
    "In how many different orders can {people} people stand in a line for a photo?",
    "A café offers {menu[0]} sandwiches, {menu[1]} drinks and {menu[2]} desserts. "
    "How many different lunches with one of each are possible?",
    "A fair coin is flipped {flips} times. What is the probability of exactly {heads} heads?",
    "A team of {chosen} is chosen from a group of {group} people. How many different teams are possible?",
    # algebra, sequences, time
    "Solve for x: {k}x + {b} = {rhs}.",
    "Two numbers add up to {sum} and differ by {diff}. What are they?",
    "What is the next number in the sequence {seq}, and what is the rule?",
    "A film starts at {clock} and lasts {hours} hours and {minutes} minutes. What time does it end?",
    "Each bus holds {seats} passengers. How many buses are needed to take {riders} people on a trip?",
    "{name} is saving for a {cur}{big} laptop and already has {cur}{b}. "
    "If {name} saves {cur}{k} a day, how many days will it take?",
)

OPENINGS = (
    "",
    "",
    "Solve this word problem: ",
    "Here's a maths question. ",
    "Can you help with my homework? ",
    "Math problem: ",
    "Quick question: ",
)
CLOSINGS = (
    "",
    "",
    " Show your working.",
    " Explain each step.",
    " Give the final answer on its own line.",
    " Think it through step by step.",
    " Explain it simply, as if to a child.",
)


class Blanks(dict[str, Any]):  # Any: names, numbers and fractions, which the draws combine
    """A problem's blanks, each drawn from ``BLANKS`` the first time a template asks for it."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    def __missing__(self, key: str) -> object:
        self[key] = value = BLANKS[key](self.rng, self)
        return value


def math_prompts(per_template: int = 150, seed: int = 0) -> Iterator[str]:
    """``per_template`` problems from every template, each with a random opening
    and closing (the variety a user's phrasing has), in a fixed order for ``seed``."""
    rng = random.Random(seed)
    for _ in range(per_template):
        for template in TEMPLATES:
            yield rng.choice(OPENINGS) + template.format_map(Blanks(rng)) + rng.choice(CLOSINGS)
