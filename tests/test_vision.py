"""Image canonicalisation, content keys, bad images, the embedding cache and encoder reuse."""

import io

import pytest
import torch
from PIL import Image

import vision.image_keys as image_keys
from vision import (EmbeddingCache, ImageError, ImageRegistry, OpenClipEncoder, VisionPipeline,
                    load_image, open_clip_vision_tower)

TINY_VIT = {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32}


def picture(seed: int = 0, size=(40, 30)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def encoded(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.fixture
def pipeline() -> VisionPipeline:
    torch.manual_seed(0)
    tower = open_clip_vision_tower(vision_cfg=TINY_VIT, embed_dim=32)
    return VisionPipeline(OpenClipEncoder(tower, torch.nn.Linear(64, 48), 32, identity="tiny"))


def test_png_and_lossless_webp_share_a_key_and_one_pixel_changes_it(pipeline, tmp_path):
    img = picture()
    path = tmp_path / "pic.png"
    path.write_bytes(encoded(img, "PNG"))
    a, b, c = pipeline.prepare([path, encoded(img, "WEBP", lossless=True), img])
    assert a.uid == b.uid == c.uid and a.key == b.key and len(a.key) == 16
    changed = img.copy()
    changed.putpixel((20, 15), (0, 0, 0) if img.getpixel((20, 15)) != (0, 0, 0) else (1, 1, 1))
    [d] = pipeline.prepare([changed])
    assert d.uid != a.uid and d.key != a.key


def test_exif_orientation_is_applied():
    img = picture(size=(40, 30))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    rotated = load_image(encoded(img, "JPEG", exif=exif.tobytes(), quality=95))
    assert rotated.size == (30, 40) and rotated.mode == "RGB"


def test_transparency_is_composited_over_white():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert load_image(rgba).getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("item, reason", [
    (b"not an image at all", "cannot be decoded: not a readable image"),
    (b"", "is empty"),
    (Image.new("RGB", (0, 7)), "zero size"),
    (Image.new("RGB", (5000, 5000)), "over the limit of 10000000"),
    (Image.new("F", (4, 4)), "unsupported mode 'F'"),
    ("/nonexistent/cat.png", "does not exist"),
    (3.14, "must be a PIL image, a path or bytes"),
])
def test_bad_images_are_named_with_the_reason(pipeline, item, reason):
    pipeline.max_pixels = 10_000_000
    with pytest.raises(ImageError, match=f"request 3 image 1: .*{reason}"):
        pipeline.prepare([picture(), item], label="request 3 image")
    good, bad = pipeline.prepare([picture(), item], errors="return")
    assert isinstance(bad, ImageError) and bad.item == "image 1" and reason.split()[0] in str(bad)
    assert good.uid >= 1


ACCEPTED = "accepted formats: PNG, JPEG, WebP, GIF, BMP"


@pytest.mark.parametrize("fmt, kw", [("PNG", {}), ("JPEG", {"quality": 95}),
                                     ("WEBP", {"lossless": True}), ("GIF", {}), ("BMP", {})])
def test_accepted_formats_decode(fmt, kw, tmp_path):
    img = picture(size=(6, 5))
    data = encoded(img, fmt, **kw)
    (tmp_path / "pic").write_bytes(data)
    for item in (data, tmp_path / "pic"):
        assert load_image(item).size == (6, 5)


@pytest.mark.parametrize("fmt", ["TIFF", "ICO", "PPM", "TGA", "PCX"])
def test_other_formats_are_refused_with_the_accepted_list(fmt, tmp_path):
    data = encoded(picture(size=(16, 16)), fmt)
    (tmp_path / "pic").write_bytes(data)
    for item in (data, tmp_path / "pic", str(tmp_path / "pic")):
        with pytest.raises(ImageError,
                           match=rf"^photo: cannot be decoded: not a readable image \({ACCEPTED}\)$"):
            load_image(item, "photo")


def test_an_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (4, 4), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=10)
    assert load_image(buf.getvalue()).getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize("data", [b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 30,
                                  encoded(picture(), "TIFF"), encoded(picture(), "PNG")[:40],
                                  encoded(picture(size=(64, 64)), "PNG")[:300]])
def test_errors_name_the_image_in_words_never_a_repr(pipeline, data, tmp_path):
    (tmp_path / "bad").write_bytes(data)
    for item in (data, tmp_path / "bad"):
        with pytest.raises(ImageError) as caught:
            pipeline.prepare([picture(), item], label="request 0 image")
        message = str(caught.value)
        assert message.startswith("request 0 image 1: ")
        assert "object at 0x" not in message and "<_io" not in message, message


def test_truncated_file_is_rejected():
    data = encoded(picture(size=(64, 64)), "PNG")
    with pytest.raises(ImageError, match="cannot be decoded"):
        load_image(data[: len(data) // 2])


def test_forced_key_collision_still_tells_images_apart(monkeypatch):
    registry = ImageRegistry(key_fn=lambda inputs, identity: b"\x00" * 16)
    a = {"pixel_values": torch.zeros(3)}
    b = {"pixel_values": torch.ones(3)}
    ua, _ = registry.identify(a, "x")
    ub, _ = registry.identify(b, "x")
    assert ua != ub and registry.identify(a, "x")[0] == ua and registry.identify(b, "x")[0] == ub


def test_registry_is_bounded_and_never_reuses_uids():
    registry = ImageRegistry(max_bytes=24)  # two 3-float images
    uids = [registry.identify({"p": torch.full((3,), float(i))}, "x")[0] for i in range(3)]
    assert len(registry) == 2 and uids == [1, 2, 3]
    again, _ = registry.identify({"p": torch.zeros(3)}, "x")  # dropped earlier: a fresh uid
    assert again == 4


def test_embedding_cache_is_lru_and_bounded():
    cache = EmbeddingCache(max_bytes=32)  # two 4-float tensors
    cache.put(1, torch.zeros(4))
    cache.put(2, torch.ones(4))
    assert cache.get(1) is not None
    cache.put(3, torch.full((4,), 3.0))
    assert cache.get(2) is None and cache.get(1) is not None and cache.get(3) is not None
    cache.put(4, torch.zeros(100))  # larger than the bound: not kept
    assert cache.get(4) is None and cache.nbytes <= 32
    assert (cache.hits, cache.misses) == (3, 2)


def test_encoder_runs_once_per_image(pipeline):
    imgs = pipeline.prepare([picture(1), picture(2), picture(1)])
    outs = [pipeline.embeddings(i) for i in imgs + imgs]
    assert pipeline.encoder.calls == 2
    assert outs[0].shape == (16, 48)  # (32 / 8)^2 patches, projected
    assert torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[1])
    assert pipeline.stats()["distinct_images"] == 2


def test_open_clip_tower_from_a_local_checkpoint(tmp_path):
    import open_clip

    torch.manual_seed(1)
    clip = open_clip.model.CLIP(embed_dim=32, vision_cfg=TINY_VIT,
                                text_cfg={"context_length": 8, "vocab_size": 50, "width": 32,
                                          "heads": 2, "layers": 1})
    torch.save(clip.state_dict(), tmp_path / "open_clip_model.bin")
    tower = open_clip_vision_tower(vision_cfg=TINY_VIT, embed_dim=32,
                                   weights=tmp_path / "open_clip_model.bin")
    for name, value in tower.state_dict().items():
        assert torch.equal(value, clip.visual.state_dict()[name]), name
    with pytest.raises(ValueError, match="unknown open_clip architecture"):
        open_clip_vision_tower("ViT-Nonexistent")
    assert open_clip_vision_tower("ViT-B-32").conv1.out_channels == 768  # any registry entry
