"""Regenerate `corpus.txt`: short plain-English stories written from a small hand-made grammar.

The text is original (no third-party copyright); a fixed seed makes it byte-identical on every run:
    python -m mconvert.data.make_corpus
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Anna", "Ben", "Clara", "David", "Ella", "Finn", "Grace", "Henry", "Iris", "Jack", "Lucy", "Max",
         "Nora", "Oscar", "Ruth", "Sam", "Tom", "Vera", "Will", "Zoe", "Arthur", "Beatrice", "Cecil", "Dorothy",
         "Edmund", "Florence", "Gilbert", "Harriet", "Isaac", "Josephine", "Lionel", "Margaret", "Nathaniel",
         "Penelope", "Quentin", "Rosalind", "Theodore", "Ursula", "Victor", "Winifred"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "rabbit", "goat", "duck", "mouse", "crow", "bear", "deer",
           "badger", "hedgehog", "squirrel", "sparrow", "pigeon", "donkey", "lamb", "kitten", "puppy", "turtle",
           "beaver", "otter", "swan", "heron", "falcon", "pony"]
PLACES = ["the river", "the old mill", "the market", "the forest", "the harbour", "the hill", "the school",
          "the garden", "the bridge", "the village", "the station", "the library", "the farm", "the lake",
          "the lighthouse", "the bakery", "the museum", "the orchard", "the cathedral", "the meadow", "the valley",
          "the workshop", "the theatre", "the hospital", "the castle", "the cottage", "the quarry", "the canal"]
OBJECTS = ["a red kite", "an old map", "a small lamp", "a loaf of bread", "a wooden box", "a silver key",
           "a blue cup", "a basket of apples", "a letter", "a warm coat", "a book of songs", "a broken clock",
           "a brass telescope", "a painted umbrella", "a jar of honey", "a knitted scarf", "a compass",
           "a violin", "a feather pillow", "a copper kettle", "a bundle of candles", "a chess board",
           "a pair of gloves", "a photograph", "a wheelbarrow", "a parcel wrapped in string"]
WEATHER = ["It was a cold morning.", "The sun was bright and the wind was soft.", "Rain fell all day.",
           "A thick fog covered the fields.", "The evening was quiet and warm.", "Snow lay on the roofs.",
           "Clouds moved fast across the sky.", "The air smelled of pine and smoke."]
FEELINGS = ["happy", "tired", "curious", "worried", "proud", "calm", "hungry", "surprised", "sad", "brave",
            "cheerful", "nervous", "grateful", "puzzled", "excited", "lonely", "patient", "delighted"]
VERBS = ["walked to", "ran to", "looked for a path to", "drove to", "hurried to", "wandered to", "came back from"]
TIMES = ["In the morning", "After lunch", "Later that day", "Before dinner", "At night", "On Sunday",
         "Early the next day", "When the bells rang"]
SAYS = ["\"We should go home now,\" said {a}.", "\"Look at this!\" said {a}.",
        "\"I have never seen {o} like this,\" said {a}.", "\"Can you help me?\" asked {a}.",
        "\"Thank you,\" said {a}, and {b} smiled.", "\"Where did you find it?\" asked {b}."]
ENDINGS = ["They walked home together and talked until it was dark.",
           "That night {a} slept well and dreamed of {p}.",
           "The next day everyone in the village knew the story.",
           "{a} kept {o} on a shelf and never forgot that day.",
           "And from then on, {a} and {b} were good friends.",
           "It was a small thing, but it made the whole week better."]
FACTS = [
    "Water boils at one hundred degrees Celsius at sea level.",
    "The moon goes around the earth about once a month.",
    "Bees carry pollen from flower to flower, and this helps fruit to grow.",
    "A year has twelve months, and most months have thirty or thirty-one days.",
    "Trees take in carbon dioxide and give out oxygen.",
    "Light travels faster than sound, so we see lightning before we hear thunder.",
    "Rivers carry water from the hills down to the sea.",
    "Bread is made from flour, water, salt and yeast.",
    "The heart pumps blood through the body all day and all night.",
    "Maps use a scale, so that a short line can stand for a long road.",
    "Mountains are often colder at the top, because the air is thinner there.",
    "Spiders spin webs of silk to catch insects for food.",
    "A compass needle points north because the earth behaves like a giant magnet.",
    "Owls hunt at night and can turn their heads almost all the way around.",
    "Glass is made by melting sand at a very high temperature.",
    "The oldest bridges were built from stone, and many of them still stand today.",
    "Volcanoes form where melted rock rises through cracks in the ground.",
    "Penguins cannot fly, but they swim quickly through icy water.",
    "Electricity flows easily through copper, which is why wires are made from it.",
    "Clocks once needed weights or springs, and someone had to wind them every week.",
    "Whales breathe air, so they must come up to the surface of the ocean.",
    "Farmers rotate their crops so that the soil stays rich and healthy.",
    "Thunderstorms happen when warm, damp air rises quickly into cold air.",
    "The library lends books for free, and readers return them after a few weeks.",
    "Orchestras combine strings, woodwind, brass and percussion instruments.",
    "Ancient sailors navigated by watching the stars and the position of the sun.",
    "Honey never spoils if it is kept in a sealed jar.",
    "Chess is played on a board of sixty-four squares, and each side has sixteen pieces.",
]


def story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    animal, place, obj = rng.choice(ANIMALS), rng.choice(PLACES), rng.choice(OBJECTS)
    fill = dict(a=a, b=b, o=obj, p=place)
    lines = [rng.choice(WEATHER),
             f"{rng.choice(TIMES)}, {a} {rng.choice(VERBS)} {place} with {'an' if animal[0] in 'aeiou' else 'a'} {animal}.",
             f"{a} felt {rng.choice(FEELINGS)}, because {b} was waiting there with {obj}.",
             rng.choice(SAYS).format(**fill),
             f"The {animal} sat down near {b} and watched the people of {rng.choice(PLACES)}.",
             rng.choice(SAYS).format(**fill),
             f"{b} was {rng.choice(FEELINGS)} and said that {obj} came from {rng.choice(PLACES)}.",
             rng.choice(FACTS),
             rng.choice(ENDINGS).format(**fill)]
    return " ".join(lines)


def build(n_stories: int = 300, seed: int = 2024) -> str:
    rng = random.Random(seed)
    return "\n\n".join(story(rng) for _ in range(n_stories)) + "\n"


if __name__ == "__main__":
    out = Path(__file__).with_name("corpus.txt")
    out.write_text(build())
    print(f"wrote {out} ({out.stat().st_size} bytes)")
