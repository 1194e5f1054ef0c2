"""Stalls: a rank that hangs makes every rank report its phase and step and the run exit non-zero within
trainer.collective_timeout_s, instead of hanging. Also the watchdog alone, and the MPPO_FAULT grammar."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from dist_util import REPO
from e2e_assets import tiny_overrides
from reliability_launch import session_assets, train

from mppo.trainer import faults
from mppo.trainer.watchdog import GRACE_S, STALL_EXIT_CODE, backstop_delay_s

TIMEOUT_S = 5


def test_hang_in_a_collective_phase_is_reported_by_every_rank_and_ends_the_run(tmp_path_factory, tmp_path):
    """TP=2: rank 1 hangs on entering step 1's rollout, so rank 0 blocks in gloo while gathering every rank's
    share of the rollout (mppo.rollout.factory). Both watchdogs fire; torchrun ends the run."""
    assets = session_assets(tmp_path_factory)
    hang = "mppo: fault injection [rank 1]: hang at step 1 phase gen"
    launch = train(tiny_overrides(assets, tmp_path / "run", world=2, tp=2, steps=2) +
                   [f"trainer.collective_timeout_s={TIMEOUT_S}", "trainer.val_before_train=false"],
                   env={"MPPO_FAULT": "hang@step:1:phase:gen:rank:1"}, marks=(hang,), log=tmp_path / "stall.log")
    assert launch.returncode != 0
    assert STALL_EXIT_CODE in launch.child_exit_codes(), launch.output[-3000:]
    for rank in (0, 1):
        stall = launch.lines(f"mppo: stall [rank {rank}]: no progress for {TIMEOUT_S} s in phase 'gen' of step 1")
        assert len(stall) == 1, launch.output[-4000:]
        assert f"trainer.collective_timeout_s={TIMEOUT_S}" in stall[0]
    # rank 0's stacks show where it waited: in gloo, gathering the rollout's responses
    assert "all_gather_object" in launch.output and "rollout/factory.py" in launch.output, launch.output[-4000:]
    # It waited the timeout, then ended promptly (far below the process group's own timeout of 2x + 60 s).
    waited = launch.seconds - launch.marks[hang]
    assert TIMEOUT_S <= waited < TIMEOUT_S + GRACE_S + 20, waited


# ------------------------------------------------------------------------------------------------ watchdog alone
def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_watchdog_fires_on_a_silent_phase_and_the_backstop_on_a_gil_holding_hang():
    """A phase with no progress for 1 s: exit 124 with the phase and step. Code that blocks while holding the GIL
    starves the watcher thread: faulthandler's C thread still ends the process. Phases that each finish in time
    never fire, however long they run together."""
    prelude = "import time, ctypes\nfrom mppo.trainer.watchdog import StallWatchdog\ndog = StallWatchdog(1.0, rank=3)\n"
    start = time.monotonic()
    silent = _python(prelude + "with dog.phase('update_actor', 7):\n    time.sleep(60)\n")
    gil = _python(prelude + "with dog.phase('gen', 2):\n    ctypes.PyDLL(None).sleep(60)  # holds the GIL\n")
    busy = _python(prelude + "for i in range(6):\n    with dog.phase('gen', i):\n        time.sleep(0.4)\n"
                   "dog.close()\nprint('finished')\n")
    out, err = silent.communicate(timeout=60)
    assert silent.returncode == STALL_EXIT_CODE, err
    assert "mppo: stall [rank 3]: no progress for 1 s in phase 'update_actor' of step 7" in err
    assert 'File "<string>", line 5 in <module>' in err  # the stacks say where: time.sleep(60)
    out, err = busy.communicate(timeout=60)
    assert busy.returncode == 0 and "finished" in out and "stall" not in err, err
    out, err = gil.communicate(timeout=60)
    assert gil.returncode == 1 and "Timeout (0:00:08)!" in err, err
    assert time.monotonic() - start < backstop_delay_s(1.0) + 20


# ------------------------------------------------------------------------------------------------ MPPO_FAULT
def test_fault_specs_parse_and_bad_ones_say_the_grammar(monkeypatch):
    kill, nan1, nan3 = faults.parse("kill@step:2:phase:update_actor:rank:1;nan_loss@step:1;nan_loss@step:3+")
    assert kill == faults.Fault("kill", step=2, phase="update_actor", rank=1)
    assert nan1.matches_step(1) and not nan1.matches_step(2)
    assert [nan3.matches_step(s) for s in (2, 3, 9)] == [False, True, True]
    (ckpt,) = faults.parse("kill@checkpoint:after:actor")
    assert ckpt.checkpoint == "after:actor" and ckpt.step is None and ckpt.matches_step(5)
    for bad, why in [("explode@step:1", "unknown fault kind"), ("kill@step:1", "needs phase"),
                     ("kill@step:x:phase:gen", "not a number"), ("hang@phase:generate", "bad phase:generate"),
                     ("nan_loss@step:1:phase:gen", "only step/rank"), ("kill@checkpoint:after", "has no value")]:
        with pytest.raises(faults.FaultSpecError, match=why):
            faults.parse(bad)
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    assert faults.from_env() is None  # unset: the trainer holds no injector at all
    monkeypatch.setenv(faults.ENV_VAR, "hang@step:1:phase:gen:rank:1")
    monkeypatch.setenv("RANK", "0")
    assert faults.from_env().faults == []  # a fault for rank 1 is not rank 0's
