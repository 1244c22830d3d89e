"""The phases of a rank's main thread: what its heartbeat says it is doing (cluster/heartbeat.py).

Written by the rank (msdist.train, run/trainer.py) and read by the stall policy (cluster/stall.py) in the rank's
watchdog and in msdist.launch's supervisor, so they are named once, here, in the layer both import. A `str` enum:
a phase is written to the heartbeat file as its plain name and a name read back compares equal to its member.
"""
import enum


class Phase(str, enum.Enum):
    START_UP = "start-up"                # cluster init, the data check, then resume and the first collectives
    COMPILE = "compile"                  # building the network and compiling the train step
    DATA_WAIT = "data wait"              # waiting for the next batch (and building an epoch's pipeline)
    TRAIN_STEP = "train step"            # the step dispatched, until it is done
    STOP_CHECK = "stop check"            # the preemption agreement after a step: a collective
    EVALUATION = "evaluation"
    CHECKPOINT_SAVE = "checkpoint save"
    EPOCH_END = "epoch end"              # the epoch's loss summed over ranks: a collective
    FINISH = "finish"                    # after the loop: the result file and the cluster's teardown

    # The plain name in str() and f-strings (the stall line) on every Python msdist supports: 3.12 changed what a
    # str-mixed enum prints.
    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__
