"""One packed row split over several ranks: the row groups and their gather (groups.py), DeepSpeed Ulysses
(ulysses.py), all-gather context parallelism (context.py), and how a rank runs its chunk of a split row
(row_split.py); the trainer's feature for either is features/row_split.py."""
