"""The bottom layer, MindSpore-free at import: this process and the job it belongs to.

How the process was launched and where its peers are (job), what the ranks of one host tell each
other before any collective (local_exchange), the device and whether MindSpore's GPU plugin would
load (device, gpu_plugin), the environment set before MindSpore loads (runtime, isa_probe),
distributed init and collectives (distributed: loads MindSpore when called), MindSpore's scheduler
(scheduler), liveness files (heartbeat), the launcher's supervisor (supervisor), and the two leaves
every layer uses: user-facing errors (errors) and atomic files (files).
Nothing here imports from msdist.engine, msdist.data or msdist.run.
"""
