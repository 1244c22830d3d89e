"""The bottom layer above msdist.base, MindSpore-free at import: this process and the job it belongs to.

What each kind of launch needs (job), how the ranks meet (rendezvous), what the ranks of one host
tell each other before any collective (local_exchange), the device and whether MindSpore's GPU
plugin would load (device, gpu_plugin), the environment set before MindSpore loads (runtime,
isa_probe), distributed init and collectives (distributed: loads MindSpore when called), MindSpore's
scheduler (scheduler), progress files and the one stall policy (heartbeat, stall), the in-rank
watchdog (watchdog) and the launcher's supervisor (supervisor, failures).
Nothing here imports from msdist.engine, msdist.data or msdist.run.
"""
