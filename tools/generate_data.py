"""Write the shipped demo preference data and its tokenizer, deterministically.

    python -m tools.generate_data            # from the repository root: rewrites trl_padfree/data, byte for byte
    python -m tools.generate_data --report   # also prints the tables of docs/guides/quickstart.md

The text is composed here from phrase banks (topics with steps, facts and common mistakes; question, follow-up and
answer templates); nothing is downloaded or copied from a dataset. Only the *lengths* model real preference data:
a mixture of short single-turn chats (UltraFeedback-like) and long multi-turn ones (Capybara-like), with lognormal
token lengths fitted to published figures (`trl_padfree.data.length_models`, docs/guides/quickstart.md).

How it runs:
1. draft pairs, sized by a word count, train a byte-level BPE tokenizer (so it never needs `<unk>`);
2. the final pairs are sized in tokens of that tokenizer: each part is filled with text units until it reaches
   the token count drawn for it.

Every random choice comes from one seeded `random.Random` (or one seeded from it), and the banks are tuples, never
sets, so neither hash randomisation nor dict order can change a byte. The tokenizer's BPE training is deterministic
too; a different `tokenizers` version could still merge differently (checked by tests/data/test_data.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trl_padfree.data import (
    DATA_DIR,
    SPLIT_FILES,
    TOKENIZER_FILE,
    length_statistics,
    load_demo_dataset,
    load_demo_tokenizer,
)
from trl_padfree.data.length_models import MULTI_TURN, SINGLE_TURN, LengthModel

SEED = 1234
NUM_TRAIN, NUM_TEST = 320, 40
NUM_DRAFT = 400  # draft pairs the tokenizer is trained on
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, in this order

MULTI_TURN_FRACTION = 0.4
SEQUENCE_CAP = 1500  # prompt + completion, so the CPU demo stays fast; TRL's max_length=1024 still cuts a tail
COMPLETION_CAP = 1000  # longer completions are redrawn; prompts are drawn down to fit the sequence cap
MIN_COMPLETION = 12
MIN_PROMPT = {"single": 12, "multi": 60}


@dataclass(frozen=True)
class Topic:
    name: str
    field: str
    task: str  # completes "How do I ...?"
    terms: tuple[str, ...]  # nouns used with "the": "the starter"
    steps: tuple[str, ...]
    facts: tuple[str, ...]
    mistakes: tuple[str, ...]


# fmt: off
TOPICS = [
    Topic(
        "sourdough bread", "cooking", "bake a loaf of sourdough bread",
        ("starter", "flour", "dough", "proofing", "crust", "oven"),
        ("Feed the starter the night before so it is bubbly and active.",
         "Mix the flour and water and let the dough rest for about an hour.",
         "Add the starter and the salt, then fold the dough every half hour for two hours.",
         "Shape the loaf gently and let it rise in a basket overnight in the fridge.",
         "Bake it in a very hot oven, first with a lid and then without it.",
         "Let the bread cool for at least an hour before you slice it."),
        ("A warm kitchen makes the dough rise faster than a cold one.",
         "The crust gets darker and crunchier when the lid comes off for the last part of baking.",
         "A starter that doubles in a few hours is strong enough to raise a loaf.",
         "Whole wheat flour absorbs more water than white flour."),
        ("Cutting the loaf while it is hot makes the inside gummy.",
         "Using a starter that has not been fed leads to a flat, dense loaf.",
         "Cutting the proofing short gives a tight crumb with a few large holes."),
    ),
    Topic(
        "tomato plants", "gardening", "grow tomatoes on a balcony",
        ("seedling", "pot", "soil", "watering", "sunlight", "fertilizer"),
        ("Pick a variety that stays compact, such as a cherry or bush tomato.",
         "Use pots that hold at least twenty litres, with holes in the bottom.",
         "Fill them with fresh potting soil mixed with a little compost.",
         "Plant the seedlings deep, so that part of the stem is under the soil.",
         "Place the pots where they get six to eight hours of sunlight a day.",
         "Water deeply in the morning and add fertilizer every two weeks once flowers appear."),
        ("Tomatoes in pots dry out much faster than tomatoes in the ground.",
         "A stake or cage keeps the plant upright when the fruit gets heavy.",
         "Regular watering prevents the fruit from cracking.",
         "Too much fertilizer gives lots of leaves but few tomatoes."),
        ("Watering a little every evening keeps the leaves wet and invites disease.",
         "Small pots crowd the roots and keep the plant weak.",
         "Putting the plants out before the nights are warm slows them down for weeks."),
    ),
    Topic(
        "sorting in Python", "programming", "sort a list of records in Python",
        ("list", "key function", "dictionary", "sorted call", "tuple", "test"),
        ("Store each record as a dictionary or a small class with named fields.",
         "Call sorted on the list and pass a key function that returns the field you care about.",
         "For several fields, return a tuple from the key function, such as the last name and then the age.",
         "Add reverse equal to True when you want the largest values first.",
         "Write a small test with three or four records to confirm the order."),
        ("The sorted call returns a new list and leaves the original list unchanged.",
         "The sort method changes the list in place and returns nothing.",
         "Python sorting is stable, so records with equal keys keep their original order.",
         "A key function is called once per element, which keeps sorting fast."),
        ("Assigning the result of the sort method to a variable gives you None.",
         "Mixing numbers and strings in the key makes the comparison fail.",
         "Sorting strings that contain numbers puts ten before two unless you convert them."),
    ),
    Topic(
        "git history", "programming", "clean up a messy git history before a review",
        ("branch", "commit", "rebase", "merge", "remote", "log"),
        ("Create a backup branch so you can always go back.",
         "Read the log and decide which commits belong together.",
         "Start an interactive rebase on top of the main branch.",
         "Squash small fixes into the commit they belong to and reword unclear messages.",
         "Run the tests again after the rebase, because the code may have changed.",
         "Push the branch to the remote with force with lease, not a plain force push."),
        ("A rebase rewrites commits, so their hashes change.",
         "A merge keeps the full history and adds one extra commit that joins two branches.",
         "Force with lease refuses to overwrite work that someone else pushed in the meantime.",
         "Small commits with clear messages make a review much faster."),
        ("Rebasing a branch that other people already use forces them to repair their copies.",
         "Squashing everything into one huge commit hides the reasoning behind each change.",
         "Forgetting to fetch before a rebase means you rebase on an old version of main."),
    ),
    Topic(
        "a monthly budget", "finance", "set up a simple monthly budget",
        ("income", "spending", "savings goal", "rent", "spreadsheet", "bank statement"),
        ("Write down your income after tax for a normal month.",
         "Collect the receipts and bank statements from the last three months.",
         "Sort the expenses into fixed costs such as rent and flexible costs such as food.",
         "Set a savings amount first and treat it like a bill.",
         "Put everything in a simple spreadsheet with one row per category.",
         "Check the numbers once a week and adjust the categories that keep running over."),
        ("Fixed costs are easier to plan than flexible ones, because they rarely change.",
         "Small daily purchases often add up to more than people expect.",
         "An emergency fund of three months of expenses gives a lot of peace of mind.",
         "Automatic transfers make saving easier because you never see the money."),
        ("Forgetting yearly bills makes some months look much better than they are.",
         "Budgets that are too strict get abandoned after a few weeks.",
         "Tracking every cent by hand takes so long that people stop doing it."),
    ),
    Topic(
        "running", "fitness", "train for a first ten kilometre run",
        ("pace", "warm-up", "rest day", "distance", "stretching", "long run"),
        ("Start with three runs a week at an easy pace where you can still talk.",
         "Increase the weekly distance by no more than about ten percent.",
         "Begin every run with a five minute warm-up of brisk walking or slow jogging.",
         "Keep at least one rest day between the harder runs.",
         "Add one longer run each week and build it up slowly to ten kilometres.",
         "Finish with some light stretching and a glass of water."),
        ("Most of the progress comes from easy runs, not from fast ones.",
         "Good running shoes should feel comfortable from the first minute.",
         "Muscles adapt faster than tendons, which is why slow progress prevents injuries.",
         "Sleep has a big effect on how quickly the body recovers."),
        ("Running every session as fast as possible leads to tired legs and injuries.",
         "Skipping the warm-up makes the first kilometre feel much harder.",
         "Buying new shoes right before the race can cause blisters."),
    ),
    Topic(
        "bicycle repair", "repair", "fix a flat tyre on a bicycle",
        ("tyre", "tube", "valve", "pump", "patch", "rim"),
        ("Remove the wheel and let out any air that is left through the valve.",
         "Use two tyre levers to lift one side of the tyre over the rim.",
         "Pull out the tube and pump a little air into it to find the hole.",
         "Roughen the area, apply the glue, wait a minute, and press the patch on firmly.",
         "Run your fingers along the inside of the tyre to find the thorn or glass that caused the flat.",
         "Put the tube back, seat the tyre on the rim, and pump it to the pressure printed on the side."),
        ("Most flats are caused by a small sharp object that stays stuck in the tyre.",
         "The right pressure makes the ride faster and the tyre less likely to puncture.",
         "A spare tube is quicker to fit on the road than a patch.",
         "Presta and Schrader valves need different pump heads or an adapter."),
        ("Using a screwdriver instead of tyre levers can cut the new tube.",
         "Forgetting to check the inside of the tyre means the next tube goes flat right away.",
         "Pumping the tyre before it sits evenly on the rim can make it burst off."),
    ),
    Topic(
        "job interviews", "career", "prepare for a job interview",
        ("resume", "company research", "example", "salary", "follow-up", "practice round"),
        ("Read the job description twice and mark the skills they ask for most.",
         "Learn what the company does, who its customers are, and what it has done recently.",
         "Prepare three or four short examples from your work that show those skills.",
         "Practice answering common questions out loud, ideally with a friend.",
         "Write down two or three questions you want to ask them.",
         "Send a short follow-up message the same day to thank them for their time."),
        ("Interviewers remember concrete examples better than general claims.",
         "A short structure of situation, action and result keeps answers focused.",
         "Knowing the usual salary range for the role makes the money talk less stressful.",
         "Good questions at the end show real interest in the job."),
        ("Reading answers from a sheet makes them sound stiff.",
         "Speaking badly about a previous employer leaves a poor impression.",
         "Having no questions at the end suggests a lack of interest."),
    ),
    Topic(
        "phone photography", "photography", "take sharper photos with a phone",
        ("light", "focus", "lens", "exposure", "frame", "grip"),
        ("Wipe the lens with a soft cloth, because fingerprints blur everything.",
         "Find soft light, for example near a window or outside in the shade.",
         "Tap the screen on the subject to set the focus and the exposure.",
         "Hold the phone with both hands and keep your elbows close to your body.",
         "Fill the frame with the subject instead of zooming in later.",
         "Take several shots and keep the sharpest one."),
        ("Phones use slower shutter speeds in dim light, which makes shaky photos more likely.",
         "Digital zoom only crops the picture and loses detail.",
         "Soft light hides small flaws and gives more even colours.",
         "The grid lines in the camera app help keep the horizon straight."),
        ("Shooting straight into a bright window leaves the face too dark.",
         "Using the flash for close portraits makes skin look flat and shiny.",
         "Pressing the shutter button too hard moves the phone at the worst moment."),
    ),
    Topic(
        "planetary orbits", "science", "understand why planets orbit the sun",
        ("gravity", "orbit", "mass", "planet", "sun", "speed"),
        ("Start with the idea that gravity pulls every mass toward every other mass.",
         "Picture a planet moving sideways at a high speed while the sun pulls it inward.",
         "Notice that the planet keeps falling toward the sun but also keeps missing it.",
         "See that this balance of sideways speed and inward pull is what we call an orbit.",
         "Compare planets: the ones closer to the sun move faster and take less time to go around."),
        ("The sun holds more than ninety nine percent of the mass of the solar system.",
         "Orbits are ellipses, although most planetary orbits are close to circles.",
         "Without gravity a planet would fly off in a straight line.",
         "A planet does not need an engine, because nothing in space slows it down."),
        ("Many people think there is no gravity in space, but it is what holds the orbit together.",
         "It is wrong to think the planets are pushed around by the light of the sun.",
         "Planets do not all move at the same speed; the distance to the sun matters a lot."),
    ),
    Topic(
        "persuasive essays", "writing", "write a persuasive essay",
        ("thesis", "paragraph", "evidence", "outline", "draft", "conclusion"),
        ("State your thesis in one clear sentence before you write anything else.",
         "Make an outline with three main reasons that support the thesis.",
         "Give each reason its own paragraph with one piece of strong evidence.",
         "Answer the strongest objection in a separate paragraph.",
         "Write a fast first draft without stopping to polish it.",
         "End with a conclusion that repeats the thesis in new words and says why it matters."),
        ("Readers are persuaded more by specific evidence than by strong words.",
         "An outline saves time, because it shows gaps before you write the full text.",
         "Reading the draft aloud reveals sentences that are too long.",
         "A good title tells the reader what position the essay takes."),
        ("Hiding the thesis in the middle of the essay confuses the reader.",
         "Listing many weak reasons is less convincing than a few strong ones.",
         "Ignoring the other side makes the argument look one sided."),
    ),
    Topic(
        "learning vocabulary", "education", "learn new Spanish vocabulary faster",
        ("vocabulary", "flashcard deck", "grammar", "listening", "practice", "notebook"),
        ("Choose the thousand most common words first, because they cover most daily speech.",
         "Put each new word on flashcards with an example sentence, not only a translation.",
         "Review the flashcards every day for about fifteen minutes, with spaced repetition.",
         "Add some listening every day, such as a podcast for learners.",
         "Use the new words in short sentences that you say or write yourself.",
         "Keep a small notebook with words you heard but did not know."),
        ("Spaced repetition shows a word again just before you would forget it.",
         "Words learned in context are easier to remember than lists of single words.",
         "Short daily practice beats one long session per week.",
         "Grammar makes more sense once you know enough words to notice patterns."),
        ("Learning long lists of rare words gives little benefit in real conversations.",
         "Only reading and never speaking leaves you unable to use what you know.",
         "Skipping reviews for a week undoes much of the progress."),
    ),
    Topic(
        "home wifi", "technology", "fix a slow home wifi network",
        ("router", "signal", "channel", "password", "cable", "firmware"),
        ("Run a speed test next to the router and again in the room where it is slow.",
         "Restart the router and the modem, and wait a few minutes for them to come back.",
         "Move the router to a central, open spot away from walls and metal objects.",
         "Update the router firmware from its settings page.",
         "Switch to a less crowded channel, or let the router pick one automatically.",
         "Use a cable for devices that do not move, such as a desktop or a television."),
        ("The signal gets weaker with every wall and floor it passes through.",
         "The five gigahertz band is faster but has a shorter range than the two point four band.",
         "Networks of the neighbours on the same channel can slow yours down.",
         "A strong password keeps other people from using your bandwidth."),
        ("Hiding the router inside a cupboard blocks a large part of the signal.",
         "Buying a faster plan does not help if the bottleneck is the wifi itself.",
         "Forgetting firmware updates leaves known bugs and security holes in place."),
    ),
    Topic(
        "coffee", "cooking", "brew better coffee at home",
        ("grind", "grinder", "water", "filter", "ratio", "temperature"),
        ("Buy whole beans roasted within the last few weeks.",
         "Grind the beans just before brewing, with a burr grinder if you can.",
         "Use a ratio of about sixty grams of coffee per litre of water.",
         "Heat the water to just below boiling, around ninety three degrees.",
         "Rinse the paper filter with hot water before adding the coffee.",
         "Pour slowly in circles and aim for a total brew time of about three minutes."),
        ("Coffee loses much of its aroma within minutes of grinding.",
         "Water that is too hot pulls out bitter flavours.",
         "A finer grind brews faster and tastes stronger.",
         "Filtered water often gives a cleaner taste than tap water."),
        ("Storing the beans in the fridge lets them pick up moisture and smells.",
         "Guessing the amount of coffee makes every cup taste different.",
         "Leaving the coffee on a hot plate for an hour makes it bitter."),
    ),
    Topic(
        "train travel", "travel", "plan a week long trip by train",
        ("ticket", "route", "luggage", "hotel", "map", "schedule"),
        ("Pick three or four places to visit, so you do not spend the whole week in transit.",
         "Draw the route on a map and check the travel time between each stop.",
         "Book the long distance tickets early, because prices rise close to the date.",
         "Choose a hotel close to each station to save time and taxi costs.",
         "Pack light, with luggage you can lift onto a rack by yourself.",
         "Keep a simple schedule with one free afternoon in every city."),
        ("Train travel lets you arrive in the centre of a city instead of at an airport outside it.",
         "Rail passes are worth it only when you take many trains in a short time.",
         "Night trains save both a hotel night and a day of travel.",
         "Seat reservations are required on some fast trains even with a pass."),
        ("Planning a new city every day leaves no time to enjoy any of them.",
         "Leaving only a few minutes to change trains causes missed connections.",
         "Heavy suitcases make stairs and crowded platforms a real struggle."),
    ),
    Topic(
        "houseplants", "gardening", "keep houseplants alive through the winter",
        ("leaf", "root", "window", "humidity", "pot", "drainage"),
        ("Move the plants closer to a bright window, because the days are shorter.",
         "Water less often and check that the top of the soil is dry first.",
         "Make sure every pot has drainage holes so the roots never sit in water.",
         "Raise the humidity with a tray of wet pebbles or by grouping plants together.",
         "Keep the plants away from radiators and cold drafts.",
         "Wipe the dust off the leaves so they can use the little light there is."),
        ("Most houseplants grow slowly in winter and need less water and no fertilizer.",
         "Overwatering kills more houseplants than underwatering.",
         "Yellow lower leaves often mean the roots are too wet.",
         "Dry indoor air from heating makes leaf tips turn brown."),
        ("Keeping the summer watering schedule drowns the roots.",
         "Repotting in the middle of winter stresses a plant that is barely growing.",
         "Placing plants right above a heater dries them out in days."),
    ),
    Topic(
        "public speaking", "career", "give a short talk without reading from notes",
        ("audience", "slide", "opening", "pause", "rehearsal", "voice"),
        ("Decide on the one message you want the audience to remember.",
         "Build the talk around three points that support that message.",
         "Write a strong opening line and learn it by heart.",
         "Use slides with pictures and a few words, not full sentences.",
         "Do at least three full rehearsals out loud, standing up.",
         "Pause after each key point and speak a little slower than feels natural."),
        ("Nervousness is normal and the audience rarely notices it.",
         "People remember stories far better than lists of facts.",
         "A short pause feels long to the speaker but natural to the listener.",
         "Eye contact with a few friendly faces makes the room feel smaller."),
        ("Putting the whole script on the slides makes people read instead of listen.",
         "Rushing to finish early makes the talk hard to follow.",
         "Apologising for being nervous draws attention to it."),
    ),
    Topic(
        "sleep", "health", "build a better sleep routine",
        ("bedtime", "screen", "caffeine", "morning light", "alarm", "nap"),
        ("Pick a fixed bedtime and wake up time, and keep them on weekends too.",
         "Stop drinking caffeine after about two in the afternoon.",
         "Turn off screens or dim them for the last hour before bed.",
         "Get bright daylight in the morning; even a short walk helps.",
         "Keep the bedroom cool, dark and quiet.",
         "Keep naps short, around twenty minutes, and not late in the day."),
        ("A regular wake up time sets the body clock more than a regular bedtime.",
         "Caffeine stays in the body for many hours after the last cup.",
         "Morning light helps you feel sleepy at the right time in the evening.",
         "Lying awake in bed for a long time teaches the brain to link the bed with being awake."),
        ("Sleeping in for hours on the weekend makes Monday night harder.",
         "Checking the phone when you wake up at night keeps the brain alert.",
         "Long late naps make it hard to fall asleep at bedtime."),
    ),
    Topic(
        "spreadsheets", "technology", "sum values by category in a spreadsheet",
        ("column", "formula", "range", "filter", "table", "chart"),
        ("Put the data in a table with one column for the category and one for the amount.",
         "Make a list of the unique categories in a separate column.",
         "Next to each category, write a SUMIF formula that points at the category range and the amount range.",
         "Lock the ranges with dollar signs so the formula can be copied down.",
         "Check one category by hand with a filter to be sure the total is right.",
         "Make a simple bar chart from the summary table."),
        ("A pivot table does the same job with a few clicks and updates when the data changes.",
         "Formulas that refer to whole columns keep working when new rows are added.",
         "Text with extra spaces counts as a different category.",
         "Named ranges make long formulas easier to read."),
        ("Forgetting to lock the ranges shifts them when the formula is copied.",
         "Typing totals by hand means they are wrong as soon as the data changes.",
         "Merged cells break sorting and filtering."),
    ),
    Topic(
        "painting a room", "home", "paint a small bedroom",
        ("primer", "brush", "roller", "tape", "wall", "ceiling"),
        ("Move the furniture to the centre and cover it and the floor with sheets.",
         "Fill holes in the walls, let the filler dry, and sand it smooth.",
         "Put painter's tape along the edges of the ceiling, the windows and the skirting boards.",
         "Apply primer on repaired spots or when covering a dark colour.",
         "Paint the ceiling first, then cut in the edges of the walls with a brush.",
         "Fill in the walls with a roller in a W pattern and add a second coat after it dries."),
        ("Good paint covers in fewer coats and saves time in the end.",
         "Removing the tape while the paint is still slightly wet gives the cleanest lines.",
         "Matte paint hides small flaws, while glossy paint shows every bump.",
         "Paint dries faster and more evenly in a well aired room."),
        ("Skipping the primer over a dark wall can mean three or four extra coats.",
         "Overloading the roller leaves drips and thick lines.",
         "Painting the walls before the ceiling means drips land on the finished walls."),
    ),
]

PERSONAS = ("complete beginner", "student", "parent with little free time", "retired teacher",
            "software developer", "small business owner", "nurse who works night shifts")

USER_CONTEXT = (
    "I am a {persona}.", "I have never tried to {task} before.",
    "I tried something similar last month and it did not go well.", "A friend told me that the {a} is the hardest part.",
    "I have about two hours a week for this.", "I do not want to spend much money.",
    "I am not sure whether the {a} or the {b} matters more.",
    "Everything I find online is either too basic or too advanced.", "I read that {fact}",
)

QUESTIONS = {
    "how_to": ("How do I {task}?", "What is the best way to {task}?", "Can you walk me through how to {task}?",
               "I want to {task}. Where should I start?"),
    "explain": ("Can you explain what the {a} does when you {task}?", "Why does the {a} matter so much for {topic}?",
                "What is the difference between the {a} and the {b} in {topic}?"),
    "advice": ("Give me some tips to {task}.", "What mistakes should I avoid when I {task}?",
               "Write a short checklist for anyone who wants to {task}."),
}
REQUESTS = ("Please keep it practical.", "Use simple words.", "A numbered list would be great.",
            "Focus on what matters most.")

FOLLOW_UPS = {
    "focus": ("Thanks, that helps. Can you say more about the {a}?", "What should I do if the {a} does not look right?",
              "How much time should I plan for the {a}?", "Is the {a} really necessary, or can I skip it?",
              "Okay. How do the {a} and the {b} affect each other?",
              "That makes sense. What is the most common mistake with the {a}?"),
    "summary": ("Could you summarize the whole process in a short list?",
                "Great. In what order would you do all of this as a complete beginner?"),
}

INTROS = {
    "how_to": ("Sure. Here is a clear way to {task}.", "Good question. To {task}, it helps to work in a fixed order.",
               "Here is a practical plan to {task}, step by step.",
               "Happy to help. Most people can {task} with a bit of patience."),
    "explain": ("Good question about the {a}.", "The {a} is worth understanding well.",
                "Sure. Here is how the {a} fits into {topic}.", "Happy to go deeper on the {a}."),
    "advice": ("Here are the points that make the biggest difference when you {task}.",
               "Sure. These tips will help you {task}."),
    "summary": ("Sure. Here is the whole process in short form.", "Of course. Here is the order I would follow."),
}

# On-topic sentences about one term (the "focus" of an explanation or a follow-up)
FOCUS_SENTENCES = (
    "In {topic}, the {a} is one of the parts that decides how everything else turns out.",
    "If the {a} is in good shape, the {b} is much easier to get right.",
    "Watch the {a} closely the first few times, because that is where you learn the most.",
    "The {a} and the {b} are linked, so a change in one shows up in the other.",
    "When the {a} looks wrong, go back one step before changing anything else.",
    "You do not need special tools for the {a}; attention and patience matter more.",
    "Most beginners underestimate the {a}, and that is why their first attempts go wrong.",
    "A good habit is to check the {a} at the same point every time.",
)
TIPS = (
    "Check the {a} before you move on to the {b}.",
    "If the {a} looks wrong, go back one step and adjust the {b}.",
    "Change one thing at a time, because the {a} and the {b} affect each other.",
    "Write down what you did with the {a}, so the next attempt is easier to compare.",
    "Most problems with the {a} come from rushing, so give it a little more time.",
    "A small change to the {a} often matters more than a big change to the {b}.",
    "Keep the {a} simple at first and add detail once the basics work.",
    "It helps to look at the {a} again the next day with fresh eyes.",
    "People who are new to {topic} often forget the {a}, but it makes a visible difference.",
    "When in doubt, compare your {a} with a known good example.",
    "The {a} is easier to get right if the {b} is already in good shape.",
    "Plan a few extra minutes for the {a}; it is the part that most often runs late.",
    "Ask for feedback on the {a} early, not after everything else is done.",
    "Once the {a} works, repeat the same routine a few times until it feels natural.",
    "Keep notes on the {a} and the {b} together, so you can see how they relate.",
)
CLOSERS = ("Hope this helps.", "Good luck!", "Let me know if any step is unclear.", "Have fun with it.",
           "Take it one step at a time.", "You will get better with practice.", "That covers the main points.",
           "Feel free to ask a follow-up question.", "Good luck.", "Enjoy.")

# What makes a rejected answer worse: evasive filler, a plain error, or (built elsewhere) another topic or repetition
EVASIVE = (
    "That is a hard question to answer.", "It really depends on your situation.",
    "Different people will tell you different things.", "I would not worry about it too much.",
    "You could try looking it up somewhere else.", "There is no single right answer here.",
    "Maybe just try something and see what happens.", "Some people like one way and some people like another.",
    "It is difficult to say without knowing more.", "In the end it is up to you.",
    "I am not sure I can help much with this.", "Things like this can go many different ways.",
    "It might work, or it might not.", "Everyone seems to have an opinion about it.",
    "You will probably figure it out as you go.", "It is one of those things that is hard to explain.",
)
WRONG = (
    "Skip the {a} entirely; it never makes any difference.", "Do the steps in reverse order, starting with the last one.",
    "Ignore the {a} until everything else has already failed.",
    "Use as much {a} as you can, because more is always better.", "There is no reason to check the {b} at any point.",
    "The {a} and the {b} are exactly the same thing, so you only need one of them.",
    "If the {a} looks wrong, that means it is working perfectly.",
    "Experts agree that the {a} should always be done last, after you have finished.",
)

# Short arithmetic questions: the one kind with a single right answer, so "wrong" means a wrong number
MATH_ITEMS = (("cups of flour", "loaf", "loaves"), ("metres of cable", "room", "rooms"),
              ("litres of water", "plant", "plants"), ("slices of bread", "sandwich", "sandwiches"),
              ("bolts", "shelf", "shelves"), ("sheets of paper", "booklet", "booklets"),
              ("tiles", "row", "rows"), ("seeds", "pot", "pots"))
MATH_CONTEXT = (
    "I am planning a small project at home.", "I want to buy everything in one trip.", "I am not good with numbers.",
    "My budget is tight, so I do not want to buy too much.", "I tried to work it out myself but got confused.",
    "I need the answer before I go to the shop.",
)
MATH_EXTRAS = (
    "If some of the {many} might go wrong, plan for a little extra.",
    "Writing the numbers down before you multiply makes mistakes easier to spot.",
    "The same method works for any amount: multiply the amount for one {one} by the number of {many}.",
    "Rounding up a little is safer than running out halfway through.",
    "A quick estimate first tells you whether the exact answer is in the right range.",
)
# fmt: on

REJECTED_KINDS = ("off_topic", "evasive", "repetitive", "wrong")
REJECTED_WEIGHTS = (0.3, 0.25, 0.2, 0.25)
MATH_REJECTED_WEIGHTS = (0.2, 0.15, 0.15, 0.5)


# ---------------------------------------------------------------------------------------------------------------------
# Sizing text to a token count
# ---------------------------------------------------------------------------------------------------------------------


class TokenCounter:
    """Counts tokens of text units, cached. Units start with whitespace and end without it, so with a byte-level
    pre-tokenizer the count of a concatenation is the sum of the counts of its units."""

    def __init__(self, count: Callable[[str], int]):
        self._count = count
        self._cache: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        if text not in self._cache:
            self._cache[text] = self._count(text)
        return self._cache[text]


def fill(units: Iterator[str], budget: int, count: TokenCounter, closers: Sequence[str] = CLOSERS) -> str:
    """Concatenate units up to the first that would go past `budget` tokens, then add the longest closers that fit.

    Units are taken in order (skipping one would break a numbered list), so the closers make up the difference.
    """
    parts, used = [], 0
    for unit in units:
        if used + count(unit) > budget:
            break
        parts.append(unit)
        used += count(unit)
    # After a list item the closing words start a paragraph of their own
    separator = "\n\n" if parts and re.match(r"\n+(\d+\.|-) ", parts[-1]) else " "
    unused = list(closers)
    while True:
        fitting = [closer for closer in unused if count(separator + closer) <= budget - used]
        if not fitting:
            break
        closer = max(fitting, key=lambda closer: count(separator + closer))  # the first of equals: order decides
        unused.remove(closer)
        parts.append(separator + closer)
        used += count(separator + closer)
        separator = " "
    return "".join(parts)


def _lower_first(sentence: str) -> str:
    return sentence[0].lower() + sentence[1:]


def _two_terms(topic: Topic, rng: random.Random, first: str | None = None) -> dict[str, str]:
    a = first or rng.choice(topic.terms)
    b = rng.choice([term for term in topic.terms if term != a])
    return {"a": a, "b": b, "topic": topic.name, "task": topic.task}


def _paragraphs(sentences: Iterable[str], rng: random.Random) -> Iterator[str]:
    """Group sentences into paragraphs of 3 to 5, each unit starting with its separator."""
    size, index = rng.randint(3, 5), 0
    for sentence in sentences:
        if index == size:
            size, index = rng.randint(3, 5), 0
        yield ("\n\n" if index == 0 else " ") + sentence
        index += 1


def _tips(
    topic: Topic, rng: random.Random, templates: Sequence[str] = TIPS, focus: str | None = None
) -> Iterator[str]:
    while True:
        yield rng.choice(templates).format(**_two_terms(topic, rng, focus))


def _list(header: str, items: Sequence[str], numbered: bool) -> Iterator[str]:
    for index, item in enumerate(items):
        bullet = f"{index + 1}." if numbered else "-"
        yield (f"\n\n{header}\n" if header and index == 0 else "\n\n" if index == 0 else "\n") + f"{bullet} {item}"


# ---------------------------------------------------------------------------------------------------------------------
# Answers (chosen, and the four kinds of rejected) as endless streams of text units
# ---------------------------------------------------------------------------------------------------------------------


def good_answer(topic: Topic, kind: str, rng: random.Random, focus: str | None = None) -> Iterator[str]:
    """On-topic and structured: an intro, the steps as a numbered list, facts, mistakes, then paragraphs of tips."""
    terms = _two_terms(topic, rng, focus)
    yield " " + rng.choice(INTROS[kind]).format(**terms)
    if kind == "explain":
        about_focus = [s for s in topic.facts + topic.mistakes if terms["a"] in s]
        sentences = [s.format(**_two_terms(topic, rng, terms["a"])) for s in rng.sample(FOCUS_SENTENCES, 4)]
        yield from _paragraphs(sentences[:2] + about_focus + sentences[2:], rng)
        yield from _list("This is where it fits in the whole process:", topic.steps, numbered=True)
    else:
        yield from _list("", topic.steps, numbered=True)
    yield from _list("A few things worth knowing:", topic.facts, numbered=False)
    yield from _list("Common mistakes to avoid:", topic.mistakes, numbered=False)
    yield from _paragraphs(_tips(topic, rng, focus=focus if kind == "explain" else None), rng)


def evasive_answer(subject: str, rng: random.Random) -> Iterator[str]:
    yield " " + rng.choice((f"Hmm, {subject} is a big subject.", "Well, that is an interesting question."))
    yield from _paragraphs((rng.choice(EVASIVE) for _ in itertools.count()), rng)


def repetitive_answer(topic: Topic, rng: random.Random) -> Iterator[str]:
    terms = _two_terms(topic, rng)
    yield " " + rng.choice(INTROS["how_to"]).format(**terms)
    loop = rng.sample(topic.steps, 2)
    while True:
        yield from (" " + sentence for sentence in loop)


def wrong_answer(topic: Topic, rng: random.Random) -> Iterator[str]:
    """Looks like the good answer, but every other step is an obvious error."""
    yield " " + rng.choice(INTROS["how_to"]).format(**_two_terms(topic, rng))
    errors = (rng.choice(WRONG).format(**_two_terms(topic, rng)) for _ in itertools.count())
    mixed = [item for step in topic.steps for item in (step, next(errors))]
    yield from _list("", mixed, numbered=True)
    yield from _paragraphs((next(errors) if rng.random() < 0.5 else tip for tip in _tips(topic, rng)), rng)


def math_answer(problem: dict, rng: random.Random, wrong: bool = False) -> Iterator[str]:
    a, b = problem["a"], problem["b"]
    if wrong:  # adds instead of multiplying, or multiplies badly: an error anyone can check
        result = a + b if rng.random() < 0.5 else a * b + rng.choice((-10, -2, 3, 10))
        operation = f"{a} + {b} = {result}" if result == a + b else f"{a} x {b} = {result}"
    else:
        result, operation = a * b, f"{a} x {b} = {a * b}"
    yield f" Each {problem['one']} needs {a} {problem['unit']}, and there are {b} {problem['many']}."
    yield f" Combine the two numbers: {operation}."
    yield f" So you need {result} {problem['unit']} in total."
    yield f" To check, {result} divided by {b} should give {a}, the amount for one {problem['one']}."
    extras = [" " + extra.format(**problem) for extra in MATH_EXTRAS]
    rng.shuffle(extras)
    yield from itertools.cycle(extras)


def math_rejected(kind: str, problem: dict, rng: random.Random) -> Iterator[str]:
    """A wrong number, an evasion, a loop over the question, or the answer to some other question."""
    if kind == "wrong":
        return math_answer(problem, rng, wrong=True)
    if kind == "evasive":
        return evasive_answer("arithmetic", rng)
    if kind == "repetitive":
        restated = f" Each {problem['one']} needs {problem['a']} {problem['unit']}."
        return itertools.cycle((restated, f" There are {problem['b']} {problem['many']}."))
    return good_answer(rng.choice(TOPICS), "how_to", rng)


def rejected_answer(kind: str, topic: Topic, rng: random.Random) -> Iterator[str]:
    if kind == "off_topic":
        other = rng.choice([t for t in TOPICS if t.field != topic.field])
        return good_answer(other, "how_to", rng)
    if kind == "evasive":
        return evasive_answer(topic.name, rng)
    return {"repetitive": repetitive_answer, "wrong": wrong_answer}[kind](topic, rng)


# ---------------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------------


def _user_context(topic: Topic, rng: random.Random) -> Iterator[str]:
    """What users add before their question: who they are, what they tried, then a pasted block of notes."""
    for template in rng.sample(USER_CONTEXT, len(USER_CONTEXT)):
        terms = _two_terms(topic, rng)
        yield " " + template.format(persona=rng.choice(PERSONAS), fact=_lower_first(rng.choice(topic.facts)), **terms)
    notes = list(topic.steps + topic.facts)
    rng.shuffle(notes)
    yield from _list("Here are my notes so far:", notes, numbered=False)
    yield from ("\n- " + tip for tip in _tips(topic, rng))


def user_turn(question: str, budget: int, context_units: Iterator[str], count: TokenCounter) -> str:
    """`User: <context> <question>`, the context filled to `budget` tokens in total."""
    context = fill(context_units, budget - count("User: " + question), count, closers=())
    separator = "\n\n" if "\n" in context else " "
    return f"User:{context}{separator if context else ' '}{question}"


def single_turn_prompt(topic: Topic, kind: str, target: int, rng: random.Random, count: TokenCounter) -> tuple:
    terms = _two_terms(topic, rng)
    question = rng.choice(QUESTIONS[kind]).format(**terms)
    if rng.random() < 0.4:
        question += " " + rng.choice(REQUESTS)
    context = _user_context(topic, rng)
    prompt = user_turn(question, target - count("\n\nAssistant:"), context, count) + "\n\nAssistant:"
    return prompt, terms["a"] if kind == "explain" else None


def multi_turn_prompt(topic: Topic, target: int, rng: random.Random, count: TokenCounter) -> tuple:
    """2 to 5 user turns; the earlier assistant answers take what is left of `target` after the user turns."""
    num_turns = min(5, 2 + (target > 350) + (target > 800) + (rng.random() < 0.3))
    first_kind = rng.choice(("how_to", "explain", "advice"))
    first_terms = _two_terms(topic, rng)
    questions = [(first_kind, first_terms["a"], rng.choice(QUESTIONS[first_kind]).format(**first_terms))]
    for _ in range(num_turns - 1):
        terms = _two_terms(topic, rng)
        follow_up = "summary" if rng.random() < 0.15 else "focus"
        questions.append((follow_up, terms["a"], rng.choice(FOLLOW_UPS[follow_up]).format(**terms)))
    users = [f"User: {question}" for _, _, question in questions]
    # The skeleton without the answers: answers start with a space and end without one, so their tokens add to it
    skeleton = "\n\n".join(turn for user in users for turn in (user, "Assistant:"))
    left = max(0, target - count(skeleton))
    weights = [0.5 + rng.random() for _ in range(num_turns - 1)]
    turns = []
    for index, (user, (kind, focus, _)) in enumerate(zip(users, questions, strict=True)):
        turns.append(user)
        if index < num_turns - 1:
            budget = int(left * weights[index] / sum(weights))
            answer_kind = "explain" if kind == "focus" else kind
            turns.append("Assistant:" + fill(good_answer(topic, answer_kind, rng, focus), budget, count))
    final_kind, final_focus, _ = questions[-1]
    return "\n\n".join(turns) + "\n\nAssistant:", ("explain" if final_kind == "focus" else final_kind), final_focus


# ---------------------------------------------------------------------------------------------------------------------
# Pairs
# ---------------------------------------------------------------------------------------------------------------------


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(median), sigma)


def draw_lengths(rng: random.Random, model: LengthModel, min_prompt: int) -> tuple[int, int, int]:
    """Token targets (prompt, chosen, rejected): completions redrawn above the cap, prompts cut to fit."""

    def completion(median: float) -> int:
        while True:
            length = round(_lognormal(rng, median, model.completion_sigma))
            if length <= COMPLETION_CAP:
                return max(MIN_COMPLETION, length)

    chosen, rejected = completion(model.chosen_median), completion(model.rejected_median)
    prompt = max(min_prompt, round(_lognormal(rng, model.prompt_median, model.prompt_sigma)))
    return min(prompt, SEQUENCE_CAP - max(chosen, rejected)), chosen, rejected


def make_pair(rng: random.Random, count: TokenCounter) -> dict[str, str]:
    multi_turn = rng.random() < MULTI_TURN_FRACTION
    model = MULTI_TURN if multi_turn else SINGLE_TURN
    prompt_len, chosen_len, rejected_len = draw_lengths(rng, model, MIN_PROMPT["multi" if multi_turn else "single"])
    topic = rng.choice(TOPICS)
    text_rng = random.Random(rng.getrandbits(64))  # text choices never shift the length draws of later pairs
    # Short questions with short answers can be arithmetic: the one kind where "wrong" is a wrong number
    if not multi_turn and max(prompt_len, chosen_len, rejected_len) <= 120 and rng.random() < 0.3:
        one_unit, one, many = rng.choice(MATH_ITEMS)
        problem = {"unit": one_unit, "one": one, "many": many, "a": rng.randint(3, 24), "b": rng.randint(3, 19)}
        question = (
            f"Each {one} needs {problem['a']} {one_unit}. How many {one_unit} do I need for {problem['b']} {many}?"
        )
        context = (" " + sentence for sentence in text_rng.sample(MATH_CONTEXT, len(MATH_CONTEXT)))
        prompt = user_turn(question, prompt_len - count("\n\nAssistant:"), context, count) + "\n\nAssistant:"
        chosen_units = math_answer(problem, text_rng)
        rejected_units = math_rejected(rng.choices(REJECTED_KINDS, MATH_REJECTED_WEIGHTS)[0], problem, text_rng)
    else:
        if multi_turn:
            prompt, answer_kind, focus = multi_turn_prompt(topic, prompt_len, text_rng, count)
        else:
            answer_kind = rng.choice(("how_to", "explain", "advice"))
            prompt, focus = single_turn_prompt(topic, answer_kind, prompt_len, text_rng, count)
        chosen_units = good_answer(topic, answer_kind, text_rng, focus)
        rejected_units = rejected_answer(rng.choices(REJECTED_KINDS, REJECTED_WEIGHTS)[0], topic, text_rng)
    return {
        "prompt": prompt,
        "chosen": fill(chosen_units, chosen_len, count),
        "rejected": fill(rejected_units, rejected_len, count),
    }


def make_pairs(num_pairs: int, seed: int, count: TokenCounter) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [make_pair(rng, count) for _ in range(num_pairs)]


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer and files
# ---------------------------------------------------------------------------------------------------------------------


def bank_sentences() -> list[str]:
    """Every fixed sentence of the phrase banks, so the tokenizer sees all of them at least once."""
    texts = [s for topic in TOPICS for s in topic.steps + topic.facts + topic.mistakes]
    for bank in (USER_CONTEXT, REQUESTS, FOCUS_SENTENCES, TIPS, CLOSERS, EVASIVE, WRONG, MATH_CONTEXT, MATH_EXTRAS):
        texts.extend(bank)
    for bank in (QUESTIONS, FOLLOW_UPS, INTROS):
        texts.extend(sentence for key in bank for sentence in bank[key])
    return texts


def train_tokenizer(texts: Sequence[str]) -> Tokenizer:
    """Byte-level BPE: every byte is in the vocabulary, so no text ever needs `<unk>`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def draft_texts() -> list[str]:
    """The first draft the tokenizer learns from: pairs sized by a rough 1.3 tokens per word."""
    count = TokenCounter(lambda text: max(1, round(1.3 * len(text.split()))))
    pairs = make_pairs(NUM_DRAFT, SEED + 1, count)
    return bank_sentences() + [text for pair in pairs for text in (pair["prompt"], pair["chosen"], pair["rejected"])]


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    lines = [json.dumps({key: row[key] for key in ("prompt", "chosen", "rejected")}) + "\n" for row in rows]
    path.write_text("".join(lines), encoding="utf-8", newline="\n")


def generate(output_dir: str | Path = DATA_DIR) -> list[Path]:
    """Train the tokenizer, generate the pairs sized in its tokens, and write the three files to `output_dir`.

    Args:
        output_dir (`str` or `Path`, *optional*, defaults to the package's `trl_padfree/data`):
            Where to write `preferences_train.jsonl`, `preferences_test.jsonl` and `tokenizer.json`.

    Returns:
        `list[Path]`: the paths written.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(draft_texts())
    count = TokenCounter(lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids))
    pairs = make_pairs(NUM_TRAIN + NUM_TEST, SEED, count)
    paths = [output_dir / SPLIT_FILES["train"], output_dir / SPLIT_FILES["test"], output_dir / TOKENIZER_FILE]
    _write_jsonl(paths[0], pairs[:NUM_TRAIN])
    _write_jsonl(paths[1], pairs[NUM_TRAIN:])
    tokenizer.save(str(paths[2]), pretty=False)
    return paths


# ---------------------------------------------------------------------------------------------------------------------
# Measurements for docs/guides/quickstart.md and the tests
# ---------------------------------------------------------------------------------------------------------------------


def is_multi_turn(prompt: str) -> bool:
    """Whether a generated prompt holds earlier turns (the Capybara-like part of the mixture)."""
    return prompt.count("User:") > 1


def simulate_length_model(model: LengthModel, num_samples: int = 100_000, seed: int = 0) -> dict[str, float]:
    """The published figures a `LengthModel` was fitted to, recomputed from its lognormals before the caps."""
    rng = np.random.default_rng(seed)
    prompt, chosen, rejected = (
        median * np.exp(sigma * rng.standard_normal(num_samples))
        for median, sigma in (
            (model.prompt_median, model.prompt_sigma),
            (model.chosen_median, model.completion_sigma),
            (model.rejected_median, model.completion_sigma),
        )
    )
    pair = prompt + chosen + rejected
    return {
        "median_pair": float(np.median(pair)),
        "median_prompt_to_completion": float(np.median(prompt / ((chosen + rejected) / 2))),
        "p95_over_median_pair": float(np.percentile(pair, 95) / np.median(pair)),
    }


def padded_batch_ratio(
    dataset, tokenizer, batch_size: int = 8, num_shuffles: int = 20, seed: int = 0, max_length: int | None = None
) -> float:
    """Fraction of a padded DPO batch that is padding, averaged over the batches of `num_shuffles` shuffles.

    Each pair gives two sequences, prompt + chosen and prompt + rejected, each with the EOS TRL appends, optionally
    truncated to `max_length`; the batch of `2 * batch_size` sequences is padded to its longest:
    `1 - real tokens / (2 * batch_size * longest)`. Incomplete last batches are dropped.
    """
    lengths = {
        column: np.array([len(ids) for ids in tokenizer(list(dataset[column]), add_special_tokens=False)["input_ids"]])
        for column in ("prompt", "chosen", "rejected")
    }
    sequences = np.stack([lengths["prompt"] + lengths["chosen"], lengths["prompt"] + lengths["rejected"]], 1) + 1
    if max_length is not None:
        sequences = np.minimum(sequences, max_length)
    rng = random.Random(seed)
    ratios = []
    for _ in range(num_shuffles):
        order = list(range(len(sequences)))
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            batch = sequences[order[start : start + batch_size]]
            ratios.append(1 - batch.sum() / (batch.size * batch.max()))
    return float(np.mean(ratios))


def report() -> str:
    """The tables of docs/guides/quickstart.md, measured on the shipped files."""
    dataset, tokenizer = load_demo_dataset(), load_demo_tokenizer()
    lines = ["Length models before the caps (100,000 draws):", ""]
    lines += ["| model | median prompt+chosen+rejected | median prompt / completion | p95 / median of the pair |"]
    lines += ["|---|---:|---:|---:|"]
    for model in (SINGLE_TURN, MULTI_TURN):
        fit = simulate_length_model(model)
        lines.append(
            f"| {model.name} | {fit['median_pair']:.0f} | {fit['median_prompt_to_completion']:.2f} "
            f"| {fit['p95_over_median_pair']:.2f} |"
        )
    for split in ("train", "test"):
        statistics = length_statistics(dataset[split], tokenizer)
        lines += ["", f"Split `{split}` ({len(dataset[split])} pairs), tokens:", ""]
        lines += ["| | mean | median | p90 | max |", "|---|---:|---:|---:|---:|"]
        for name, row in statistics.items():
            lines.append(f"| {name} | {row['mean']:.1f} | {row['median']:.0f} | {row['p90']:.0f} | {row['max']} |")
    train = dataset["train"]
    lines += ["", "Train split by kind, medians in tokens (target = the model's median):", ""]
    lines += ["| kind | pairs | prompt (target) | chosen (target) | rejected (target) | pair |"]
    lines += ["|---|---:|---:|---:|---:|---:|"]
    for model, multi_turn in ((SINGLE_TURN, False), (MULTI_TURN, True)):
        part = train.filter(lambda row, multi_turn=multi_turn: is_multi_turn(row["prompt"]) == multi_turn)
        medians = {name: row["median"] for name, row in length_statistics(part, tokenizer).items()}
        lines.append(
            f"| {model.name} | {len(part)} | {medians['prompt']:.0f} ({model.prompt_median:.0f}) "
            f"| {medians['chosen']:.0f} ({model.chosen_median:.0f}) "
            f"| {medians['rejected']:.0f} ({model.rejected_median:.0f}) | {medians['pair']:.0f} |"
        )
    full, truncated = padded_batch_ratio(train, tokenizer), padded_batch_ratio(train, tokenizer, max_length=1024)
    lines += ["", f"Padding of 8-pair batches (train, 20 shuffles): {full:.3f}; with max_length=1024: {truncated:.3f}"]
    sequences = [
        len(ids) + 1  # + the EOS TRL appends
        for completion in ("chosen", "rejected")
        for ids in tokenizer([row["prompt"] + row[completion] for row in train], add_special_tokens=False)["input_ids"]
    ]
    lines.append(f"Sequences longer than 1024 tokens (with EOS): {np.mean(np.array(sequences) > 1024):.1%}")
    sizes = {path.name: path.stat().st_size for path in sorted(DATA_DIR.glob("*.json*"))}
    lines.append(f"File sizes: {sizes}, total {sum(sizes.values()):,} bytes")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=str(DATA_DIR), help="where to write the files")
    parser.add_argument(
        "--report", action="store_true", help="print the tables of docs/guides/quickstart.md (shipped files)"
    )
    args = parser.parse_args(argv)
    for path in generate(args.output_dir):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    if args.report:
        print(report())


if __name__ == "__main__":
    main()
