"""`python tests/launch_with_nfs_delay.py ARGS`: `msdist.launch` whose view of the shared claim files lags as an NFS
client's may (tests/nfs_delay.py, with MSDIST_TEST_NFS_DELAY=S). Everything else is the real launcher."""
import os
import sys

import nfs_delay  # tests/ is sys.path[0] when this file runs as a script

if os.environ.get(nfs_delay.ENV):
    nfs_delay.install(float(os.environ[nfs_delay.ENV]))

from msdist.launch import main  # noqa: E402  (after the shim: the launcher's own imports see it)

sys.exit(main())
