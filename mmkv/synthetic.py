"""Synthetic scenes and documents with checkable answers, deterministic from a seed.

Scenes are 96x96 pictures drawn with Pillow: one to four shapes (circle, square, triangle) in six
colours and two sizes, each in its own cell of a 3x3 grid. Questions ask for a count, a colour, a
position, a presence (yes/no) or a full description of the grid, cell by cell ("top left: small red
circle. top: empty. ...", dozens of tokens).

Documents are city reports: five record lines (``population 452,031.``) among filler sentences,
with instructions to extract a field or to summarise the report in one line listing every field.

The bundled model is trained on these (``examples/train_tiny.py``) and evaluated on held-out seeds
(``python -m mmkv.eval``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from PIL import Image, ImageDraw

IMAGE_SIZE = 96
CELL = IMAGE_SIZE // 3
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (40, 70, 220),
           "yellow": (235, 200, 20), "purple": (140, 50, 170), "orange": (245, 130, 20)}
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": 6, "large": 13}  # half-extent in pixels
POSITIONS = ("top left", "top", "top right", "left", "centre", "right",
             "bottom left", "bottom", "bottom right")
NUMBERS = ("zero", "one", "two", "three", "four")
SCENE_TEMPLATE = "<image>question: {question}\nanswer:"
DOCUMENT_TEMPLATE = "{document}\ninstruction: {question}\nanswer:"
# The bundled model's chat template renders exactly the prompts above: a user turn holding an image
# and a question is SCENE_TEMPLATE; a system turn (a document) and a user turn are DOCUMENT_TEMPLATE.
# An assistant turn is its answer and <eos>, as in training (where a report is followed by several
# instructions); a later user turn asks again. An image part renders as <image>, before the text.
CHAT_TEMPLATE = (
    "{%- set state = namespace(document=false, asked=false) -%}"
    "{%- for message in messages -%}"
    "{%- set turn = namespace(images='', text='') -%}"
    "{%- if message['content'] is string -%}{%- set turn.text = message['content'] -%}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{%- set turn.images = turn.images + '<image>' -%}"
    "{%- elif part['type'] == 'text' -%}{%- set turn.text = turn.text + part['text'] -%}"
    "{%- else -%}{{- raise_exception('content parts are text or image, got ' + part['type']) -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] in ['system', 'developer'] -%}"
    "{{- turn.images + turn.text -}}{%- set state.document = true -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{%- if state.document -%}{{- turn.images + '\ninstruction: ' + turn.text -}}"
    "{%- else -%}{{- ('\n' if state.asked else '') + turn.images + 'question: ' + turn.text -}}"
    "{%- endif -%}{{- '\nanswer:' -}}{%- set state.asked = true -%}"
    "{%- elif message['role'] == 'assistant' -%}{{- ' ' + turn.text | trim + eos_token -}}"
    "{%- else -%}{{- raise_exception('roles are system, developer, user or assistant, got '"
    " + message['role']) -}}"
    "{%- endif -%}{%- endfor -%}"
)


@dataclass(frozen=True, slots=True)
class Shape:
    kind: str
    colour: str
    size: str
    cell: int  # 0..8, reading order


@dataclass(frozen=True, slots=True)
class QA:
    question: str
    answer: str
    kind: str


@dataclass(frozen=True, slots=True)
class Scene:
    shapes: tuple[Shape, ...]

    def render(self) -> Image.Image:
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        for s in self.shapes:
            cx, cy = (s.cell % 3) * CELL + CELL // 2, (s.cell // 3) * CELL + CELL // 2
            r, fill = SIZES[s.size], COLOURS[s.colour]
            if s.kind == "circle":
                draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
            elif s.kind == "square":
                draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
            else:
                draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
        return image

    def describe(self) -> str:
        """Every cell in reading order: ``top left: small red circle. top: empty. ...``."""
        at = {s.cell: f"{s.size} {s.colour} {s.kind}" for s in self.shapes}
        return " ".join(f"{POSITIONS[c]}: {at.get(c, 'empty')}." for c in range(9))

    def answer(self, question: str) -> str:
        """The true answer to any question of the forms ``scene_questions`` asks."""
        for pattern, solve in _SCENE_RULES:
            m = re.fullmatch(pattern, question)
            if m:
                return solve(self, *m.groups())
        raise ValueError(f"not a scene question this generator knows: {question!r}")


def _count_kind(scene: Scene, kind: str) -> str:
    return NUMBERS[sum(s.kind == kind for s in scene.shapes)]


def _colour_of(scene: Scene, kind: str) -> str:
    [shape] = [s for s in scene.shapes if s.kind == kind]
    return shape.colour


def _position_of(scene: Scene, colour: str, kind: str) -> str:
    [shape] = [s for s in scene.shapes if (s.colour, s.kind) == (colour, kind)]
    return POSITIONS[shape.cell]


def _presence(scene: Scene, colour: str, kind: str) -> str:
    return "yes" if any((s.colour, s.kind) == (colour, kind) for s in scene.shapes) else "no"


def _at(scene: Scene, position: str) -> str:
    at = [s for s in scene.shapes if POSITIONS[s.cell] == position]
    return f"a {at[0].colour} {at[0].kind}" if at else "nothing"


_SCENE_RULES = (
    (r"how many shapes are there\?", lambda sc: NUMBERS[len(sc.shapes)]),
    (r"describe the scene\.", Scene.describe),
    (r"how many (\w+)s are there\?", _count_kind),
    (r"what colour is the (\w+)\?", _colour_of),
    (r"where is the (\w+) (\w+)\?", _position_of),
    (r"is there a (\w+) (\w+)\?", _presence),
    (r"what is at the ([\w ]+)\?", _at),
)


def random_scene(rng: random.Random) -> Scene:
    cells = rng.sample(range(9), rng.randint(1, 4))
    return Scene(tuple(Shape(rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(SIZES)), c)
                       for c in sorted(cells)))


def scene_questions(scene: Scene, rng: random.Random) -> list[QA]:
    """One question of every kind that has a unique answer for this scene."""
    shapes = scene.shapes
    asked = [("how many shapes are there?", "count"), ("describe the scene.", "describe"),
             (f"how many {rng.choice(SHAPES)}s are there?", "count_kind")]
    unique = [s for s in shapes if sum(t.kind == s.kind for t in shapes) == 1]
    if unique:
        asked.append((f"what colour is the {rng.choice(unique).kind}?", "colour"))
    distinct = [s for s in shapes if sum((t.colour, t.kind) == (s.colour, s.kind) for t in shapes) == 1]
    if distinct:
        s = rng.choice(distinct)
        asked.append((f"where is the {s.colour} {s.kind}?", "position"))
    colour, kind = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    if rng.random() < 0.5:
        colour, kind = rng.choice(sorted({(s.colour, s.kind) for s in shapes}))
    asked.append((f"is there a {colour} {kind}?", "presence"))
    asked.append((f"what is at the {POSITIONS[rng.randrange(9)]}?", "at_position"))
    return [QA(q, scene.answer(q), kind) for q, kind in asked]


SYLLABLES = ("ka", "lo", "mer", "an", "dri", "vel", "to", "sa", "bren", "qui", "dor", "el", "fa",
             "nu", "ris", "tal", "zo", "hal", "mi", "gar")
FIRST = ("anna", "boris", "clara", "dmitri", "elena", "felix", "greta", "hugo", "iris", "jonas",
         "karin", "leo", "maria", "nils", "olga", "peter", "rosa", "simon", "tara", "viktor")
LAST = ("berg", "novak", "silva", "moreau", "keller", "lind", "costa", "weber", "holm", "rossi",
        "marek", "vidal", "ferro", "brandt", "ivanova", "dahl")
INDUSTRIES = ("fishing", "mining", "textile", "software", "shipping", "farming", "tourism", "steel")
RIVERS = ("amber", "silver", "north", "willow", "stone", "cold", "long", "black")
FILLER = (
    "the old market opens every morning.", "the winters are long and the summers are mild.",
    "a railway line connects it to the coast.", "the central square has a clock tower.",
    "many visitors come for the autumn festival.", "the university was built near the harbour.",
    "most houses are made of red brick.", "the city council meets twice a month.",
    "a large park lies to the east of the centre.", "the library holds many old maps.",
    "buses run through the city all night.", "the museum shows the history of the region.",
)


@dataclass(frozen=True, slots=True)
class Report:
    name: str
    population: str
    founded: str
    mayor: str
    river: str
    industry: str
    text: str

    def summary(self) -> str:
        return (f"{self.name}: population {self.population}, founded {self.founded}, mayor "
                f"{self.mayor}, river {self.river}, industry {self.industry}.")


REPORT_FILLERS = (5, 9)


def random_report(rng: random.Random, fillers: tuple[int, int] = REPORT_FILLERS) -> Report:
    """A report: five record lines (``population 452,031.``: the field's name right before its
    value) among ``fillers`` (a range) filler sentences, in random order."""
    name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
    population = f"{rng.randint(2, 950)},{rng.randint(0, 999):03d}"
    founded = str(rng.randint(1100, 1950))
    mayor = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    river, industry = rng.choice(RIVERS), rng.choice(INDUSTRIES)
    facts = [f"population {population}.", f"founded {founded}.", f"mayor {mayor}.",
             f"river {river}.", f"industry {industry}."]
    sentences = facts + rng.sample(FILLER, rng.randint(*fillers))
    rng.shuffle(sentences)
    text = f"report on {name}. " + " ".join(sentences)
    return Report(name, population, founded, mayor, river, industry, text)


def report_questions(report: Report) -> list[QA]:
    """Field answers name their field (``population 452,031``), as the report and summary do."""
    n = report.name
    return [QA(f"what is the population of {n}?", f"population {report.population}", "population"),
            QA(f"when was {n} founded?", f"founded {report.founded}", "founded"),
            QA(f"who is the mayor of {n}?", f"mayor {report.mayor}", "mayor"),
            QA(f"which river runs through {n}?", f"river {report.river}", "river"),
            QA(f"what is the main industry of {n}?", f"industry {report.industry}", "industry"),
            QA("summarise the report.", report.summary(), "summary")]


def scene_prompt(question: str) -> str:
    return SCENE_TEMPLATE.format(question=question)


def document_prompt(report: Report, question: str) -> str:
    return DOCUMENT_TEMPLATE.format(document=report.text, question=question)


def scene_examples(seed: int, n: int) -> list[tuple[Scene, QA]]:
    """``n`` (scene, question) pairs, several questions per scene."""
    rng = random.Random(seed)
    out: list[tuple[Scene, QA]] = []
    while len(out) < n:
        scene = random_scene(rng)
        qs = scene_questions(scene, rng)
        out.extend((scene, qa) for qa in rng.sample(qs, min(3, len(qs))))
    return out[:n]


def document_examples(seed: int, n: int) -> list[tuple[Report, QA]]:
    rng = random.Random(seed)
    out: list[tuple[Report, QA]] = []
    while len(out) < n:
        report = random_report(rng)
        out.extend((report, qa) for qa in rng.sample(report_questions(report), 2))
    return out[:n]
