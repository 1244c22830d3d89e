"""run/evaluation.py: class counts, top-5 and the confusion matrix from summed integer counts."""
import numpy as np


def test_class_counts_top5_and_confusion():
    from msdist.run.evaluation import class_counts, summarize_counts
    logits = np.array([[9, 1, 2, 3, 4, 5, 6],     # true 0, predicted 0
                       [9, 1, 2, 3, 4, 5, 6],     # true 6: second best, top-5 hit
                       [9, 1, 2, 3, 4, 5, 6],     # true 1: last, a top-5 miss
                       [0, 0, 5, 0, 0, 0, 0]], dtype=np.float32)  # true 2, predicted 2
    labels = np.array([0, 6, 1, 2])
    counts = class_counts(logits, labels, 7) + class_counts(logits[:1], labels[:1], 7)  # summed like ranks
    metrics = summarize_counts(counts, 0.0, 7)
    assert (metrics["correct"], metrics["top5_correct"], metrics["num_samples"]) == (3, 4, 5)
    assert metrics["confusion_matrix"][0][0] == 2 and metrics["confusion_matrix"][6][0] == 1
    assert metrics["confusion_matrix"][1][0] == 1 and metrics["confusion_matrix"][2][2] == 1
    assert metrics["per_class_accuracy"][:3] == [1.0, 0.0, 1.0] and metrics["per_class_accuracy"][3] is None
    few = summarize_counts(class_counts(logits[2:3, :3], labels[2:3], 3), 0.0, 3)  # true 1 ranks last of 3
    assert (few["correct"], few["top5_correct"]) == (0, 1)  # fewer than 5 classes: top-5 covers all of them
