"""What runs inside the compiled step: network construction and mixed precision, the train step,
gradient reducers, SyncBatchNorm, loss scale, optimizer and LR schedule, EMA of the weights.

precision is MindSpore-free (config validation uses it before MindSpore loads); the others import
MindSpore. Imports only from the layers below it (msdist.rank, msdist.cluster, msdist.base) and models.
"""
