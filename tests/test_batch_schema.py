"""The step's batch has one declaration (mppo/workers/batch_schema.py): every key the trainer and the workers read
or write is declared there, and a real step's batch has the declared shapes and dtypes (recorded for every
advantage estimator by tests/dist/trainer_estimators.py, in test_trainer_estimators' launch)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mppo.workers.batch_schema import BATCH, MICRO_BATCH, READERS, read_by

ROOT = Path(__file__).resolve().parents[1]
# The names the trainer and the workers give a batch, a global (gathered) batch or a micro-batch.
BATCH_NAMES = {"batch", "full", "data", "extra", "greedy", "local_batch", "mb", "view", "micro", "mini"}


def _batch_keys_in_code() -> dict[str, set[str]]:
    """key -> modules: every string key that code in mppo/trainer and mppo/workers reads from, writes to, tests for
    or builds into a variable named as a batch (subscript, .get/.pop/.setdefault, `in`, a dict literal)."""
    found: dict[str, set[str]] = {}

    def name_of(node: ast.AST) -> str | None:
        return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None

    def key_of(node: ast.AST) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    for path in sorted([*(ROOT / "mppo" / "trainer").glob("*.py"), *(ROOT / "mppo" / "workers").glob("*.py")]):
        module = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            pairs = []
            if isinstance(node, ast.Subscript):
                pairs.append((node.value, node.slice))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                    and node.func.attr in ("get", "pop", "setdefault"):
                pairs.append((node.func.value, node.args[0]))
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                pairs.append((node.comparators[0], node.left))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                pairs += [(t, k) for t in targets for k in node.value.keys if k is not None]
            for holder, key in pairs:
                if name_of(holder) in BATCH_NAMES and key_of(key) is not None:
                    found.setdefault(key_of(key), set()).add(module)
    return found


def test_code_reads_only_declared_keys():
    undeclared = {k: sorted(m) for k, m in _batch_keys_in_code().items() if k not in BATCH and k not in MICRO_BATCH}
    assert not undeclared, f"batch keys used but not declared in mppo/workers/batch_schema.py: {undeclared}"


def test_the_scan_sees_the_batch():
    """The scan is what makes the test above able to fail: it finds the keys the step is built from."""
    seen = _batch_keys_in_code()
    for key in ("input_ids", "old_log_probs", "advantages", "token_level_scores", "reward_baselines",
                "response_index", "rollout_is_weights"):
        assert key in seen, key


def test_declarations_are_complete():
    for name, key in {**BATCH, **MICRO_BATCH}.items():
        assert key.shape.startswith("[") and key.dtype in ("int64", "int32", "float32", "bool"), name
        assert key.readers and set(key.readers) <= set(READERS), name
        assert key.writer, name
    with pytest.raises(KeyError, match="unknown reader"):
        read_by("advantage")


def test_estimator_inputs_are_batch_keys():
    """core_algos declares what an estimator may need; each is a batch key the advantages gather ("index" is the
    prompt's `uid`)."""
    from mppo.core_algos import BATCH_INPUTS

    names = {"index": "uid"}
    for name in BATCH_INPUTS:
        key = names.get(name, name)
        assert key in BATCH, name
        assert key == "rollout_is_weights" or key in read_by("advantages"), name


def _size(dim: str, sizes: dict[str, int]) -> int:
    return sum(sizes[part.strip()] for part in dim.split("+"))


def check_batch_specs(specs: dict[str, list]) -> None:
    """A recorded batch ({key: [shape, dtype]}) against the declaration."""
    sizes = {"B": specs["responses"][0][0], "T": specs["responses"][0][1], "P": specs["prompt_mask"][0][1]}
    for name, (shape, dtype) in specs.items():
        assert name in BATCH, f"{name} is not declared"
        declared = BATCH[name]
        dims = [d for d in declared.shape.strip("[]").split(",")]
        assert len(shape) == len(dims), (name, shape, declared.shape)
        for size, dim in zip(shape, dims):
            if dim.strip() in ("L", "k"):
                continue
            expected = int(dim) if dim.strip().isdigit() else _size(dim, sizes)
            assert size == expected, (name, shape, declared.shape)
        assert dtype == declared.dtype, (name, dtype, declared.dtype)


def test_the_shape_check_can_fail():
    good = {"responses": [[4, 3], "int64"], "prompt_mask": [[4, 5], "int64"], "input_ids": [[4, 8], "int64"]}
    check_batch_specs(good)
    with pytest.raises(AssertionError):
        check_batch_specs({**good, "input_ids": [[4, 7], "int64"]})
    with pytest.raises(AssertionError):
        check_batch_specs({**good, "advantages": [[4, 3], "float64"]})
    with pytest.raises(AssertionError, match="not declared"):
        check_batch_specs({**good, "advantage": [[4, 3], "float32"]})
