"""The best checkpoint's policy: a model evaluated better than every one before it (a higher accuracy; a tie keeps
the earlier) becomes this rank's `{prefix}_rank{r}_best.ckpt`. Its file and sidecar are the format's
(`checkpoint.py`); the Saver (`checkpoint_saver.py`) owns one `Best` per run."""
import os
from typing import Dict, List, Optional, Tuple

from msdist.run import checkpoint


def _stamp(path: str) -> Optional[Tuple[int, int, int]]:
    """What changes when a file is rewritten, truncated or replaced: its inode, size and mtime; None when missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class Best:
    """This rank's best checkpoint so far, and the rule that replaces it.

    Trusted without hashing the whole file at every evaluation: the file is hashed (checked against its sidecar's
    sha256) the first time this process reads it and again only when its inode, size, mtime or sidecar changed;
    the file this process writes is trusted as written. Loading it (evaluation, predict, export) verifies it
    in full (`checkpoint.read_tensors`).
    """

    def __init__(self, directory: str, prefix: str, rank: int):
        self.path = checkpoint.best_path(directory, prefix, rank)
        self._trusted: Optional[tuple] = None   # (stamp, sidecar sha256) of the file last written or verified here

    def read(self) -> Optional[dict]:
        """The best checkpoint's sidecar (epoch, accuracy, ...) when it exists and verifies, else None."""
        sidecar = checkpoint.read_training_sidecar(self.path)
        if sidecar is None or "accuracy" not in sidecar:
            return None
        seen = (_stamp(self.path), sidecar["sha256"])
        if seen != self._trusted:
            if checkpoint.verify(self.path) is not None:
                return None
            self._trusted = seen
        return sidecar

    def offer(self, params: List[dict], state: Dict, accuracy: float, meta: Optional[Dict] = None,
              saved: Optional[str] = None) -> bool:
        """Make `params` the best checkpoint when `accuracy` beats the best so far.

        Written like every checkpoint (tmp, fsync, rename, then the sidecar with its sha256); the sidecar
        also holds `accuracy`. Every rank sees the same summed accuracy, so all ranks decide alike.

        Args:
            saved: a checkpoint that already holds exactly `params` (and training state): the best becomes
                a hard link to it instead of a second copy of the model.

        Returns:
            Whether a new best was written.
        """
        best = self.read()
        if best is not None and accuracy <= best["accuracy"]:
            return False
        if saved is None or not checkpoint.link(saved, self.path, accuracy=accuracy):
            checkpoint.save_as(params, self.path, state, meta, accuracy=accuracy)
        # Written here: its sidecar's sha256 was computed from this very file (or the one it links).
        self._trusted = (_stamp(self.path), checkpoint.read_sidecar(self.path)["sha256"])
        return True
