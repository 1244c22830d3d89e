"""A background checkpoint write that never finishes, for the tests: nothing here is imported by msdist.

With MSDIST_TEST_HANG_WRITE="RANK:STEP", rank RANK's save of global step STEP, when a background thread
writes it (msdist/run/background_save.py), writes half the tensors to the hidden temporary the real write
uses, then hangs, the way a write to a stalled file system looks. Installed by tests/train_with_test_models.py.
"""
import os
import threading
import time

ENV = "MSDIST_TEST_HANG_WRITE"


def install(spec: str) -> None:
    from msdist.run import checkpoint  # MindSpore-free at import: start-up has not prepared MindSpore yet

    rank, step = (int(v) for v in spec.split(":"))
    real_save = checkpoint.save

    def save(params, directory, prefix, this_rank, state, meta=None):
        if (this_rank, state["global_step"]) != (rank, step) or threading.current_thread() is threading.main_thread():
            return real_save(params, directory, prefix, this_rank, state, meta)
        import mindspore as ms
        name = checkpoint.file_name(prefix, this_rank, state["epoch"], state["step"])
        ms.save_checkpoint(params[:len(params) // 2], os.path.join(directory, f".{name}.tmp.ckpt"))
        time.sleep(3600)
        raise AssertionError("unreachable")

    checkpoint.save = save
