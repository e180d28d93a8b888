"""The package's structure against its targets, read with `ast` by tools/measure/package_structure.py (whose docstring
gives each rule): settings read once, by the resolver; no feature reading another's private state; refusals imported
from their concern's module; no import cycle and none running up; a short set-up walk from `PaddingFree.enable`. The
tool's rules are checked first on a small package written here, so that a target of 0 cannot pass by measuring
nothing."""

from pathlib import Path

import pytest

from tools.measure.package_structure import measure

WALK_STOPS = 25
WALK_CLIMBS = 4
# The issue's measure: the trainer and what `enable` derives from it (the models, the collator) followed into the
# calls that receive them. The tool's stricter figure also follows the model through the architecture check's own
# helpers (`verify_packable` and below, about 30 functions that read its config); it prints every rule's figure
ISSUE_WALK = "trainer-start-functions"


@pytest.fixture(scope="module")
def report():
    return measure()


def test_no_setting_read_again_outside_the_resolver(report):
    assert not report.settings_reads, "\n".join(map(str, report.settings_reads))


def test_no_feature_reads_another_features_private_state(report):
    reads = report.cross_feature_reads
    assert not reads, "\n".join(f"{read.site} (stored in {read.owner})" for read in reads)


def test_refusals_are_imported_from_their_concern(report):
    assert not report.refusals_reexports, report.refusals_reexports


def test_no_import_cycle(report):
    assert not report.room_cycles_with_lazy
    assert not report.module_cycles_with_lazy


def test_no_import_running_up(report):
    running_up = [f"{edge.importer}:{edge.line} ({edge.kind}) -> {edge.target}" for edge in report.imports_running_up]
    assert not running_up, running_up


def test_set_up_walk_is_short(report):
    walk = report.walks[ISSUE_WALK]
    assert len(walk.stops) <= WALK_STOPS, "\n".join(map(str, walk.stops))
    assert len(walk.climbs()) <= WALK_CLIMBS, "\n".join(map(str, walk.climbs()))


TOY = {
    "__init__.py": "",
    "low.py": (
        "def helper(value):\n    return value\n\n\ndef twin(value):\n    return value\n\n\n"
        "def late():\n    from .mid import work\n\n    return work\n"
    ),
    "mid/__init__.py": "from ..low import helper\n",
    "mid/work.py": (
        "from toy.low import helper, twin\n\n\n"
        "def _read(value):\n    return value\n\n\n"
        "def check(value):\n    return value\n\n\n"
        "def step(trainer):\n    read, built = _read(trainer.model), twin(trainer.model)\n"
        "    check(read)\n    helper(built)\n    return getattr(trainer.args, 'size', 1)\n"
    ),
    "settings.py": "def resolve(args):\n    return getattr(args, 'size', 1)\n",
    "features/__init__.py": "",
    "features/a.py": (
        "from ..mid.work import step\n\n\n"
        "class A:\n    def enable(self, trainer):\n        step(trainer)\n        return trainer._b_state\n"
    ),
    "features/b.py": "def set_up(trainer):\n    trainer._b_state = 1\n",
    "ring_one.py": "from . import ring_two\n",
    "ring_two.py": "from . import ring_one\n",
    "refusals/__init__.py": "from .config import check_one\n\n__all__ = ['check_one']\n",
    "refusals/config.py": "def check_one():\n    pass\n",
}


def test_the_rules_on_a_small_package(tmp_path: Path):
    for name, text in TOY.items():
        (tmp_path / "toy" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "toy" / name).write_text(text)
    toy = measure(tmp_path, "toy", "toy/settings.py", ("toy.features.a", "A.enable"))
    assert [(site.file, site.line) for site in toy.settings_reads] == [("toy/mid/work.py", 16)]
    assert [(read.site.file, read.attribute) for read in toy.cross_feature_reads] == [
        ("toy/features/a.py", "_b_state")
    ]
    assert toy.refusals_reexports == ["check_one"]
    assert toy.room_cycles == [["toy.ring_one", "toy.ring_two"]]
    assert toy.module_cycles == [["toy.ring_one", "toy.ring_two"]]
    assert [(edge.importer, edge.target) for edge in toy.imports_running_up] == [("toy.low", "toy.mid.work")]
    assert toy.rooms["toy.features"] == 2 and toy.rooms["toy.mid"] == 1 and toy.rooms["toy.low"] == 0
    # what a private helper reads on is followed (`check`), a public function's new object is not (`helper`)
    stops = [(stop.function.qualname, stop.floor) for stop in toy.walk.stops]
    assert stops == [("step", 1), ("_read", 1), ("twin", 0), ("check", 1)]
    assert [stop.function.qualname for stop in toy.walk.climbs("room")] == ["check"]  # back up from low to mid
