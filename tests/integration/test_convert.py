"""`python -m msdist.pretrained convert` and what its output is used by: export, predict, --resume, --pretrained.

A converted checkpoint carries every field of the metadata export and predict read, its sha256 sidecar,
and weights alone. torchvision's own ResNet-18 is the reference for the logits (torch is a test
reference only: `pip install -e ".[reference]"`; those tests skip without it).
"""
import json
import os
import struct

import numpy as np
import pytest

from conftest import run_msdist, tiny_args
from test_torch_weights import IMAGE_SIZE, _onnx_logits, _relative_gap, _torch_model, assert_predicts_torchs_top5, \
    torch_logits_on_test_images
from torch_files import _model_params, _write_torch_named


def _stderr_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def _old_converted(tmp_path) -> str:
    """A resnet_tiny converted before convert recorded the input size and class names: no sidecar either."""
    import mindspore as ms
    from models import create_model
    from msdist.run import checkpoint
    path = str(tmp_path / "old.ckpt")
    meta = {"model": "resnet_tiny", "num_classes": 4, "convention": "torch", "converted_from": "tiny.safetensors"}
    ms.save_checkpoint(create_model("resnet_tiny", 4, convention="torch"), path,
                       append_dict={checkpoint.META_KEY: json.dumps(meta)})
    return path


# ---------------------------------------------------------------- what convert writes

def test_convert_records_every_inference_field_with_a_sidecar(tmp_path):
    from msdist.base.errors import CheckpointError
    from msdist.data import pipeline
    from msdist.run import checkpoint, checkpoint_model, weights
    _write_torch_named(_model_params("resnet_tiny", 4), tmp_path / "tiny.safetensors")
    out = tmp_path / "tiny.ckpt"
    proc = run_msdist("pretrained", ["convert", str(tmp_path / "tiny.safetensors"), str(out)])
    assert f"wrote {out} (resnet_tiny, 4 classes: 0, 1, 2, ...; input 224x224; torch padding)" in proc.stdout
    meta = checkpoint_model.stored_meta(str(out))
    assert meta == {"model": "resnet_tiny", "num_classes": 4, "convention": "torch",
                    "converted_from": "tiny.safetensors", "image_size": 224, "classes": ["0", "1", "2", "3"],
                    "mean": meta["mean"], "std": meta["std"]}
    assert (meta["mean"], meta["std"]) == (list(pipeline.MEAN), list(pipeline.STD))  # what msdist normalizes with
    # The sidecar, as every checkpoint has: its sha256 is checked whenever the file is read.
    assert checkpoint.verify(str(out)) is None
    assert json.loads((tmp_path / "tiny.ckpt.json").read_text())["sha256"] == checkpoint.sha256_file(str(out))
    with open(out, "r+b") as f:  # a flipped byte is caught, not loaded
        f.seek(os.path.getsize(out) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="failed its integrity check: sha256 mismatch"):
        weights.read(str(out))

    # Told the input size and the class names (a file, one a line), and converted again from msdist's own file:
    (tmp_path / "names.txt").write_text("apple\nlemon\n\nmango\nraspberry\n")
    run_msdist("pretrained", ["convert", str(tmp_path / "tiny.safetensors"), str(out), "--image_size", "32",
                              "--classes", str(tmp_path / "names.txt")])
    again = tmp_path / "again.ckpt"
    run_msdist("pretrained", ["convert", str(out), str(again)])
    for path in (out, again):
        meta = checkpoint_model.stored_meta(str(path))
        assert (meta["image_size"], meta["classes"]) == (32, ["apple", "lemon", "mango", "raspberry"])


def test_convert_refuses_class_names_that_do_not_fit_in_one_line(tmp_path):
    _write_torch_named(_model_params("resnet_tiny", 4), tmp_path / "tiny.safetensors")
    proc = run_msdist("pretrained", ["convert", str(tmp_path / "tiny.safetensors"), str(tmp_path / "out.ckpt"),
                                     "--classes", "imagenet"], check=False)
    assert _stderr_line(proc) == ("msdist: error: --classes imagenet names 1000 classes and the model has 4; pass a "
                                  "file of 4 names, or --classes index")
    assert not (tmp_path / "out.ckpt").exists()


def test_the_shipped_imagenet_names_are_torchvisions(torchvision):
    from msdist.run import inference
    _, tv = torchvision
    names = inference.class_names("imagenet", 1000)
    assert names == tv.models.ResNet18_Weights.IMAGENET1K_V1.meta["categories"]
    assert names == tv.models.ResNet50_Weights.IMAGENET1K_V2.meta["categories"]


# ---------------------------------------------------------------- a checkpoint without those fields

def test_export_and_predict_name_a_missing_field_and_the_option_that_supplies_it(tmp_path, data_dir):
    ckpt = _old_converted(tmp_path)
    image = os.path.join(data_dir, "Test", "apple", sorted(os.listdir(os.path.join(data_dir, "Test", "apple")))[0])
    missing = (f"msdist: error: checkpoint {ckpt} records no image_size and no classes: pass --image_size N and "
               "--classes imagenet|index|FILE")
    export = ["--ckpt", ckpt, "--format", "ONNX", "--output", str(tmp_path / "m")]
    assert _stderr_line(run_msdist("export", export, check=False)) == missing
    assert _stderr_line(run_msdist("predict", ["--ckpt", ckpt, image], check=False)) == missing
    assert _stderr_line(run_msdist("predict", ["--ckpt", ckpt, "--classes", "index", image], check=False)) == \
        f"msdist: error: checkpoint {ckpt} records no image_size: pass --image_size N"
    assert not (tmp_path / "m.onnx").exists()
    # Given them, both run.
    proc = run_msdist("export", export + ["--image_size", "32", "--classes", "index"])
    assert "input 1x3x32x32, 4 classes" in proc.stdout
    assert json.loads((tmp_path / "m.onnx.json").read_text())["classes"] == ["0", "1", "2", "3"]
    proc = run_msdist("predict", ["--ckpt", ckpt, "--image_size", "32", "--classes", "index", "--json", "true", image])
    [record] = json.loads(proc.stdout)["predictions"]
    assert sorted(p["class"] for p in record["predictions"]) == ["0", "1", "2", "3"]


# ---------------------------------------------------------------- --resume and --pretrained

@pytest.mark.multiprocess
def test_resume_from_converted_weights_refuses_and_points_to_pretrained(tmp_path, data_dir):
    _write_torch_named(_model_params("resnet_tiny", 4), tmp_path / "tiny.safetensors")
    converted = str(tmp_path / "tiny.ckpt")
    run_msdist("pretrained", ["convert", str(tmp_path / "tiny.safetensors"), converted])
    proc = run_msdist("train", tiny_args(data_dir, tmp_path / "run", "--max_steps", 1, "--resume", converted),
                      check=False)
    assert _stderr_line(proc) == (f"msdist: error: --resume {converted}: it holds a model's weights alone (no "
                                  "optimizer state, no position to resume from); start training from them with "
                                  f"--pretrained {converted}")


# ---------------------------------------------------------------- bfloat16 and other dtypes in .safetensors

def _write_safetensors(path, tensors: dict) -> None:
    """{name: (dtype code, shape, raw bytes)} in the safetensors layout: header size, JSON header, the data."""
    header, offset = {}, 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    encoded = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + b"".join(data for _, _, data in tensors.values()))


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even (as torch's .to(torch.bfloat16))."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_bfloat16_safetensors_load_as_float32_and_convert(tmp_path):
    from msdist.run import checkpoint, weights
    from torch_files import _torch_name
    params = _model_params("resnet_tiny", 4)
    tensors, widened = {}, {}
    for name, value in params.items():
        bits = _bfloat16_bits(value)
        tensors[_torch_name(name)] = ("BF16", value.shape, bits.tobytes())
        widened[name] = (bits.astype(np.uint32) << 16).view(np.float32)
    tensors["bn1.num_batches_tracked"] = ("I64", (), np.array(7, np.int64).tobytes())
    _write_safetensors(tmp_path / "bf16.safetensors", tensors)
    source = weights.read(str(tmp_path / "bf16.safetensors"))
    assert (source.kind, source.architecture) == ("torch", "resnet_tiny")
    for name, value in widened.items():
        assert source.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(source.tensors[name], value, err_msg=name)
    assert np.abs(widened["fc.weight"] - params["fc.weight"]).max() > 0  # it was rounded: a real bfloat16 file
    run_msdist("pretrained", ["convert", str(tmp_path / "bf16.safetensors"), str(tmp_path / "bf16.ckpt")])
    converted = weights.read(str(tmp_path / "bf16.ckpt"))
    for name, value in widened.items():
        np.testing.assert_array_equal(converted.tensors[name], value, err_msg=name)
    assert checkpoint.verify(str(tmp_path / "bf16.ckpt")) is None


def test_a_dtype_numpy_cannot_hold_is_named_in_one_line(tmp_path):
    from msdist.base.errors import CheckpointError
    from msdist.run import weights
    _write_safetensors(tmp_path / "fp8.safetensors", {"conv1.weight": ("F8_E4M3", (2, 2), bytes(4))})
    with pytest.raises(CheckpointError) as info:
        weights.read(str(tmp_path / "fp8.safetensors"))
    assert str(info.value) == (f"{tmp_path / 'fp8.safetensors'}: tensor conv1.weight is F8_E4M3, which msdist does "
                               "not read (float64/32/16, bfloat16 and integer tensors only); save the weights in "
                               "float32")


# ---------------------------------------------------------------- torchvision's own model as the reference

@pytest.fixture(scope="module")
def converted(torchvision, tmp_path_factory, data_dir):
    """torchvision's ResNet-18 (random weights, BatchNorm statistics unlike a fresh model's) as .safetensors,
    converted at the input size the images are prepared at, and its own logits on real images."""
    from safetensors.torch import save_file
    torch, tv = torchvision
    folder = tmp_path_factory.mktemp("converted")
    model = _torch_model(torch, tv, "resnet18")
    save_file(model.state_dict(), str(folder / "resnet18.safetensors"))
    ckpt = str(folder / "resnet18.ckpt")
    run_msdist("pretrained", ["convert", str(folder / "resnet18.safetensors"), ckpt, "--image_size",
                              str(IMAGE_SIZE)])
    files, images, expected = torch_logits_on_test_images(torch, model, data_dir, per_class=2)
    categories = tv.models.ResNet18_Weights.IMAGENET1K_V1.meta["categories"]
    return {"ckpt": ckpt, "folder": folder, "files": files, "images": images, "expected": expected,
            "categories": categories}


def test_converted_weights_export_to_onnx_with_torchs_logits(converted, tmp_path):
    assert _relative_gap(_onnx_logits(converted["ckpt"], converted["images"], tmp_path), converted["expected"]) < 1e-4
    meta = json.loads((tmp_path / "model.onnx.json").read_text())
    assert (meta["image_size"], meta["classes"]) == (IMAGE_SIZE, converted["categories"])


def test_converted_weights_export_to_mindir_with_torchs_logits(converted, tmp_path):
    import mindspore as ms
    from mindspore import nn
    images = converted["images"]
    run_msdist("export", ["--ckpt", converted["ckpt"], "--format", "MINDIR", "--output", str(tmp_path / "model"),
                          "--batch_size", str(len(images))])
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    got = nn.GraphCell(ms.load(str(tmp_path / "model.mindir")))(ms.Tensor(images)).asnumpy()
    assert _relative_gap(got, converted["expected"]) < 1e-4


def test_converted_weights_predict_torchs_classes_by_imagenet_name(converted):
    assert_predicts_torchs_top5(converted["ckpt"], converted["files"], converted["expected"], converted["categories"])
