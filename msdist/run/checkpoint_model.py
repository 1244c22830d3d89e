"""The model's part of a checkpoint: its metadata, and its weights apart from the training state.

The metadata (`model_meta`: model name, class count, input size, normalization, class names, padding
convention, and for training checkpoints the batch layout) is what lets eval, predict, export and resume
rebuild the same network, and the same training, from the checkpoint alone. This module is its one home:
how it is made, read (`stored_meta`, `read_meta`, `resume_meta`) and interpreted (`meta_convention`,
`recorded_slots`). The file layout that carries it (`checkpoint.META_KEY`) is
`checkpoint.py`'s.
"""
import json
import os
from typing import Dict, Optional

from models import DEFAULT_CONVENTION
from msdist.base.errors import CheckpointError
from msdist.data import pipeline
from msdist.run import checkpoint, checkpoint_sets


BATCH_SLOTS_KEY = "batch_slots"


def model_meta(model: str, num_classes: int, image_size: int, classes: Dict[str, int], convention: str,
               batch_slots: Optional[int] = None) -> dict:
    """What a checkpoint must carry to be used on its own: stored by training in every checkpoint.

    Args:
        convention: how the network pads (models.CONVENTIONS), so whatever rebuilds it builds the same one.
        batch_slots: training's batch layout (`plan.BatchLayout.slots`), which a resume at any world size keeps.
    """
    meta = {"model": model, "num_classes": num_classes, "image_size": image_size,
            "classes": sorted(classes, key=classes.get), "mean": list(pipeline.MEAN), "std": list(pipeline.STD),
            "convention": convention}
    return meta if batch_slots is None else {**meta, BATCH_SLOTS_KEY: batch_slots}


def stored_meta(path: str) -> Dict:
    """The model metadata of checkpoint `path`, {} when it has none (model zoo, MindCV, a missing file).

    The sidecar's copy when there is one, else the string inside the file: the tensors are never read.
    Checkpoints from before issue 28 have no "convention" in it (models.DEFAULT_CONVENTION applies).
    """
    sidecar = checkpoint.read_sidecar(path)
    if sidecar is not None and "meta" in sidecar:
        return sidecar["meta"]
    if not os.path.isfile(path):
        return {}
    raw = checkpoint.read_entries(path, choice_func=_meta_and_one_entry())
    return json.loads(raw[checkpoint.META_KEY]) if checkpoint.META_KEY in raw else {}


def _meta_and_one_entry():
    """A load_checkpoint choice_func that keeps the metadata string and the first entry read, nothing else:
    MindSpore refuses a selection that comes out empty, as it would for a file without metadata."""
    kept = []

    def choose(name: str) -> bool:
        if name == checkpoint.META_KEY:
            return True
        if not kept:
            kept.append(name)
            return True
        return False
    return choose


def meta_convention(meta: Dict) -> str:
    """The padding convention (models.CONVENTIONS) a checkpoint's network was built with; metadata from before
    issue 28, and files without any (model zoo, MindCV), mean MindSpore's."""
    return meta.get("convention", DEFAULT_CONVENTION)


def read_meta(path: str) -> Dict:
    """The model metadata stored in checkpoint `path` (model, num_classes, image_size, classes, convention).

    Raises:
        CheckpointError: the file is missing, unreadable, or was not written by msdist.train.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} not found")
    meta = stored_meta(path)
    if not meta:
        raise CheckpointError(f"checkpoint {path} holds no model metadata (model, classes, image_size); use a "
                              "checkpoint written by this version of msdist.train")
    return meta


def resume_source(resume: str, directory: str, prefix: str, rank: int) -> str:
    """A checkpoint of the run `--resume` continues, read before the ranks agree on one ("" for a fresh start).

    The network and the batch layout are made before the resume reads the tensors, and must be made as that
    run's were. With `auto`, rank 0's file of the newest checkpoint complete in the directory (the one the ranks
    will agree on, `resume_point`); where no complete one is seen (each node its own disk), this rank's newest
    file, or rank 0's (a grown job's new rank has none of its own).
    """
    if resume != "auto":
        return resume
    key, entries = checkpoint_sets.newest_seen(directory, prefix)
    if key is not None:
        return checkpoint_sets.file_of(entries, key, 0).path
    found = checkpoint.list_checkpoints(directory, prefix, rank) or checkpoint.list_checkpoints(directory, prefix, 0)
    return found[0].path if found else ""


def resume_meta(resume: str, directory: str, prefix: str, rank: int) -> Dict:
    """The metadata of the checkpoint `--resume` will restore ({} when there is none to restore)."""
    source = resume_source(resume, directory, prefix, rank)
    return stored_meta(source) if source else {}


def recorded_slots(path: str, world_size: int) -> int:
    """The batch layout (slots) of the run that wrote training checkpoint `path`.

    A checkpoint from before the layout was recorded counts as its own job's world size: the ranks whose files
    sit beside it at its position; when fewer are there (files copied alone), as this job's, the old behaviour.
    """
    recorded = stored_meta(path).get(BATCH_SLOTS_KEY)
    return int(recorded) if recorded else max(checkpoint_sets.ranks_beside(path), world_size)


def training_state_prefixes() -> tuple:
    """What a training checkpoint holds besides the model, by parameter-name prefix, as each component
    declares it in its own module: the optimizer's moments and step counter, the reducer's residuals,
    the loss scale, the EMA. `Saver` refuses state outside these, so evaluation, prediction and export
    (`load_weights`) always know which part is the model.
    """
    from msdist.engine import ema, loss_scale, optim, reducers  # MindSpore: only where checkpoints are read
    return optim.STATE_PREFIXES + (reducers.RESIDUAL_PREFIX, loss_scale.STATE_PREFIX, ema.PREFIX)


def is_training_state(name: str) -> bool:
    """Whether a checkpoint entry is training state (optimizer, residuals) rather than part of the model."""
    return name.startswith(training_state_prefixes())


def load_weights(path: str, net) -> None:
    """Load the model's part of a checkpoint into `net` (evaluation, prediction, export).

    Raises:
        CheckpointError: as `checkpoint.load`; training state in the file is ignored, anything else must fit.
    """
    import mindspore as ms
    params = checkpoint.load(path, checkpoint.shapes_of(net.get_parameters()),
                             optional_prefixes=training_state_prefixes())["params"]
    ms.load_param_into_net(net, params, strict_load=True)
