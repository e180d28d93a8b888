"""One packed row split over several ranks: the row groups and their gather (groups.py), DeepSpeed Ulysses
(ulysses.py), all-gather context parallelism (context.py), and what the trainer does for either (row_split.py)."""
