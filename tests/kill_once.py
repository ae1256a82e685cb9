"""Test-only entry point that torchrun runs in place of ``gallery_lib.run.train``: the training module, except that in
the job's first attempt the worker of global rank ``GALLERY_TEST_KILL_RANK`` SIGKILLs itself after the backward of
step ``GALLERY_TEST_KILL_STEP`` (from 0), as the OOM killer or a lost host ends a worker. With
``GALLERY_TEST_KILL_PAUSE`` seconds the other workers pause there first, as in a long step: they notice the lost peer
only after torchrun's agents have."""

import os
import runpy
import signal
import time

import gallery_lib.run.nonfinite as nonfinite

RANK, STEP = int(os.environ["GALLERY_TEST_KILL_RANK"]), int(os.environ["GALLERY_TEST_KILL_STEP"])
PAUSE = float(os.environ.get("GALLERY_TEST_KILL_PAUSE", 0))
finite_check = nonfinite.all_ranks_finite
steps = 0


def kill_once(loss, dist):  # the loop's non-finite guard calls it once per step, after the backward
    global steps
    if steps == STEP and dist.restarts == 0:
        if dist.rank == RANK:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(PAUSE)
    steps += 1
    return finite_check(loss, dist)


nonfinite.all_ranks_finite = kill_once
runpy.run_module("gallery_lib.run.train", run_name="__main__", alter_sys=True)
