"""The demo's second task (``tools.task=units``): questions about measures that an agent answers with
a unit converter.

"A trail is 14 miles long. How long is it in kilometres?" needs a factor a 135M model does not
know, so the agent has to call ``convert`` with the value and both units, read the result the app
sends back, and state it with its unit. The reward has another shape than the calculator's: **1
when the last number of the final reply is within 1% of the answer and the reply names the unit
asked for; 0.5 when the number is right but the unit is missing; else 0**. Four kinds of measure
(``l`` length, ``m`` mass, ``v`` volume, ``t`` temperature, whose conversion is not a factor), each
with five phrasings. Pure logic, no I/O.
"""

from __future__ import annotations

import json
import math
import random
import re
from typing import Any

from services.demo.task import Problem, Task, tool_arguments
from services.demo.tools_task import last_number

CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "description": "Convert a measure from one unit to another (length, mass, volume or temperature).",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
            "required": ["value", "from", "to"]},
    },
}

# unit -> (kind, factor to the kind's base unit, names it goes by). Temperatures are converted apart.
_UNITS: dict[str, tuple[str, float, tuple[str, ...]]] = {
    "kilometres": ("l", 1000.0, ("km", "kilometre", "kilometer", "kilometers")),
    "metres": ("l", 1.0, ("m", "metre", "meter", "meters")),
    "centimetres": ("l", 0.01, ("cm", "centimetre", "centimeter", "centimeters")),
    "miles": ("l", 1609.344, ("mi", "mile")),
    "feet": ("l", 0.3048, ("ft", "foot")),
    "inches": ("l", 0.0254, ("in", "inch")),
    "kilograms": ("m", 1.0, ("kg", "kilogram", "kilo", "kilos")),
    "grams": ("m", 0.001, ("g", "gram")),
    "pounds": ("m", 0.45359237, ("lb", "lbs", "pound")),
    "ounces": ("m", 0.028349523125, ("oz", "ounce")),
    "litres": ("v", 1.0, ("l", "litre", "liter", "liters")),
    "millilitres": ("v", 0.001, ("ml", "millilitre", "milliliter", "milliliters")),
    "gallons": ("v", 3.785411784, ("gal", "gallon")),
    "cups": ("v", 0.2365882365, ("cup",)),
    "celsius": ("t", 1.0, ("c", "°c", "degrees celsius", "centigrade")),
    "fahrenheit": ("t", 1.0, ("f", "°f", "degrees fahrenheit")),
    "kelvin": ("t", 1.0, ("k", "kelvins")),
}
_ALIASES = {alias: unit for unit, (_, _, names) in _UNITS.items() for alias in (unit, *names)}


def unit(name: Any) -> str | None:
    """The unit a name means (case, spaces and a leading "degrees" ignored), or None."""
    if not isinstance(name, str):
        return None
    key = " ".join(name.lower().split())
    return _ALIASES.get(key) or _ALIASES.get(key.removeprefix("degrees ").strip())


def _to_celsius(value: float, u: str) -> float:
    return {"celsius": value, "fahrenheit": (value - 32) * 5 / 9, "kelvin": value - 273.15}[u]


def _from_celsius(value: float, u: str) -> float:
    return {"celsius": value, "fahrenheit": value * 9 / 5 + 32, "kelvin": value + 273.15}[u]


def convert(value: float, source: str, target: str) -> float:
    """``value`` in unit ``source`` expressed in unit ``target`` (both canonical names of the same kind)."""
    if _UNITS[source][0] == "t":
        return _from_celsius(_to_celsius(value, source), target)
    return value * _UNITS[source][1] / _UNITS[target][1]


def show(value: float) -> str:
    """A result as the tool writes it: two decimals at most (four significant digits below 1), none when whole."""
    small = 0 < abs(value) < 1
    decimals = 3 - math.floor(math.log10(abs(value))) if small else 2
    text = f"{round(value, decimals):.{decimals}f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def run_tool_call(name: str, arguments: str | dict[str, Any]) -> str:
    """What the app sends back for one call of the model (never raises: a bad call gets an error text)."""
    arguments = tool_arguments(name, "convert", arguments)
    if isinstance(arguments, str):
        return arguments
    value = arguments.get("value")
    if isinstance(value, str):
        try:
            value = float(value.replace(",", ""))
        except ValueError:
            return f"error: value {value!r} is not a number"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return 'error: arguments must be {"value": number, "from": unit, "to": unit}'
    source, target = unit(arguments.get("from")), unit(arguments.get("to"))
    for given, found in ((arguments.get("from"), source), (arguments.get("to"), target)):
        if found is None:
            return f"error: unknown unit {given!r}; known: {', '.join(_UNITS)}"
    if _UNITS[source][0] != _UNITS[target][0]:
        return f"error: cannot convert {source} to {target}"
    if abs(value) > 1e12:
        return "error: value too large"
    return show(convert(float(value), source, target))


# ---------------------------------------------------------------------------------------- reward


def names_unit(reply: str, target: str) -> bool:
    """Whether ``reply`` names ``target`` by any of its names (whole words, case ignored)."""
    text = reply.lower()
    names = (target, *_UNITS[target][2])
    # short names ("m", "in", "°c") count only between a number and the end or a punctuation mark, so
    # "98.43 in total" never names inches
    return any(re.search(rf"(?<![a-z°]){re.escape(n)}(?![a-z])", text) if len(n.strip("°")) > 2 else
               re.search(rf"\d\s*{re.escape(n)}(?=\s*(?:[^\w\s]|$))", text) for n in names)


def score(p: Problem, final_reply: str | None) -> float:
    """1.0 when the last number of the final reply is within 1% of the answer (0.005 when the answer is
    0) and the reply names the unit asked for; 0.5 with the right number but no unit; else 0.0."""
    value = last_number(final_reply)
    if value is None or abs(value - p.answer) > (0.01 * abs(p.answer) or 0.005):
        return 0.0
    return 1.0 if names_unit(final_reply, json.loads(p.expression)["to"]) else 0.5


# ---------------------------------------------------------------------------------------- questions

_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jude", "Kemi", "Luis",
          "Mia", "Noor", "Omar", "Pia", "Ravi", "Sara", "Tom", "Uma"]

# (kind, template): {v} the value, {f} / {t} the units from and to, {n} a name. The demonstrations show
# the first phrasing of each kind and the plain one; traffic and the held-out problems use all of them.
_TEMPLATES: list[tuple[str, str]] = [
    ("l", "A trail is {v} {f} long. How long is it in {t}?"),
    ("l", "{n} ran {v} {f} this morning. How many {t} is that?"),
    ("l", "A rope measures {v} {f}. What is its length in {t}?"),
    ("l", "The shelf is {v} {f} wide. How wide is it in {t}?"),
    ("l", "Convert {v} {f} to {t}."),
    ("m", "A bag of rice weighs {v} {f}. How much is that in {t}?"),
    ("m", "{n}'s suitcase weighs {v} {f}. What is its weight in {t}?"),
    ("m", "A parcel has a mass of {v} {f}. How many {t} is that?"),
    ("m", "The recipe needs {v} {f} of butter. How many {t} is that?"),
    ("m", "Convert {v} {f} to {t}."),
    ("v", "A jug holds {v} {f} of water. How many {t} is that?"),
    ("v", "{n} drank {v} {f} of juice. How much is that in {t}?"),
    ("v", "A tank contains {v} {f} of fuel. What is that in {t}?"),
    ("v", "The soup uses {v} {f} of stock. How many {t} is that?"),
    ("v", "Convert {v} {f} to {t}."),
    ("t", "The oven is set to {v} degrees {f}. What is that in degrees {t}?"),
    ("t", "Yesterday it was {v} degrees {f} outside. What is that in {t}?"),
    ("t", "The water reached {v} degrees {f}. How hot is that in degrees {t}?"),
    ("t", "The room is at {v} degrees {f}. What is the temperature in {t}?"),
    ("t", "Convert {v} degrees {f} to {t}."),
]
OPERATIONS = "lmvt"
# which units a question of each kind goes between (both ways)
_PAIRS = {
    "l": [("miles", "kilometres"), ("feet", "metres"), ("inches", "centimetres"), ("kilometres", "metres")],
    "m": [("pounds", "kilograms"), ("ounces", "grams"), ("kilograms", "grams")],
    "v": [("gallons", "litres"), ("cups", "millilitres"), ("litres", "millilitres")],
    "t": [("celsius", "fahrenheit"), ("fahrenheit", "celsius"), ("celsius", "kelvin")],
}


def _problem(text: str, kind: str, index: int, value: float, source: str, target: str, name: str = "Ana") -> Problem:
    value = int(value) if float(value).is_integer() else value
    shown = f"{value:g}"
    args = {"value": value, "from": source, "to": target}
    question = text.format(v=shown, f=source.capitalize() if kind == "t" else source,
                           t=target.capitalize() if kind == "t" else target, n=name)
    return Problem(question=question, expression=json.dumps(args), answer=float(show(convert(value, source, target))),
                   template=index, task="units")


def make_problem(rng: random.Random, template: int | None = None) -> Problem:
    index = rng.randrange(len(_TEMPLATES)) if template is None else template
    kind, text = _TEMPLATES[index]
    source, target = rng.choice(_PAIRS[kind])
    if kind != "t" and rng.random() < 0.5:
        source, target = target, source
    # whole values mostly, a half now and then; temperatures as a thermometer reads them
    value = float(rng.randint(-20, 240)) if kind == "t" else rng.randint(2, 400) + (0.5 if rng.random() < 0.25 else 0.0)
    return _problem(text, kind, index, value, source, target, rng.choice(_NAMES))


def _pool(index: int, value: float, source: str, target: str) -> Problem:
    kind, text = _TEMPLATES[index]
    return _problem(text, kind, index, value, source, target, "Lena")


# Hand-written, two per kind first (a word problem, then the plain phrasing), then two more word problems
# for length and mass, as in the calculator's pool.
DEMONSTRATION_POOL: list[Problem] = [
    _pool(0, 14, "miles", "kilometres"),
    _pool(4, 250, "centimetres", "inches"),
    _pool(5, 12, "pounds", "kilograms"),
    _pool(9, 800, "grams", "kilograms"),
    _pool(10, 3, "gallons", "litres"),
    _pool(14, 2.5, "cups", "millilitres"),
    _pool(15, 180, "celsius", "fahrenheit"),
    _pool(19, 98, "fahrenheit", "celsius"),
    _pool(1, 5, "kilometres", "miles"),
    _pool(3, 6, "feet", "metres"),
    _pool(6, 45, "pounds", "kilograms"),
    _pool(8, 8, "ounces", "grams"),
]


def final_reply(p: Problem) -> str:
    """How the demonstrations state the result: the number, then the unit asked for."""
    return f"That is {show(p.answer)} {json.loads(p.expression)['to']}."


def hint(p: Problem) -> str:
    """What the simulated user says after a wrong answer (``tools.words=hints``)."""
    args = json.loads(p.expression)
    return f"Call convert with value {args['value']:g}, from {args['from']} and to {args['to']}, then state its result in {args['to']}."


def right_form(p: Problem, arguments: dict[str, Any]) -> bool:
    """Whether a call converts between the problem's two units, whatever its value."""
    args = json.loads(p.expression)
    return unit(arguments.get("from")) == args["from"] and unit(arguments.get("to")) == args["to"]


TASK = Task(
    name="units", tool=CONVERT, operations=OPERATIONS, templates=_TEMPLATES, pool=DEMONSTRATION_POOL,
    make_problem=lambda rng, template=None: make_problem(rng, template), run_tool_call=run_tool_call, score=score,
    arguments=lambda p: json.loads(p.expression), tool_result=lambda p: show(p.answer), final_reply=final_reply,
    hint=hint, tool_label="the converter", arguments_word="units", graded=True,
    max_tokens=52,  # the call takes 41-48 with its tags
    right_form=right_form,
    loop_cap_s=640.0,  # its run took 919 s at 690 (20 of 24 versions): 226 s outside the loop, against the calculator's ~200
)
