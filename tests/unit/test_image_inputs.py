"""Images in prompts on the router's side: Markdown and chat sources, data URLs, the URL fetch's rules against a
local HTTP server on 127.0.0.1, every limit's 422, and the image token counts against transformers' processors."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import io
import json
import threading
import time
from typing import ClassVar

import pytest
from PIL import Image

from kettle.router.errors import ValidationError
from kettle.router.images import tokens as image_tokens
from kettle.router.images.check import ImageLimits, check_count, check_image
from kettle.router.images.fetch import FetchPolicy, decode_data_url, is_public, read_image_bytes
from kettle.router.images.prompt import ImageReader
from kettle.router.images.sources import ImageRef, chat_images, split_markdown
from tests.vision_fixtures import make_llava_folder


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (8, 6), frames: int = 1) -> bytes:
    out = io.BytesIO()
    images = [Image.new("RGB", size, (40 * i, 100, 200)) for i in range(frames)]
    images[0].save(out, format=fmt, save_all=frames > 1, append_images=images[1:])
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def message(error: pytest.ExceptionInfo) -> str:
    return str(error.value)


# --- sources


def test_markdown_images_split_the_inputs_in_order():
    pieces = split_markdown("Look ![](http://a/x.png) and ![a cat](data:image/png;base64,AA==)?")
    assert pieces == ["Look ", ImageRef("http://a/x.png"), " and ", ImageRef("data:image/png;base64,AA=="), "?"]
    assert split_markdown("no images [here](x)") == ["no images [here](x)"]


def test_chat_image_parts_in_order_and_one_without_url_refused():
    contents = [
        "plain",
        [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u1"}}],
        [{"type": "image_url", "image_url": "u2"}],
    ]
    assert chat_images(contents) == [ImageRef("u1"), ImageRef("u2")]
    with pytest.raises(ValidationError) as error:
        chat_images([[{"type": "image_url", "image_url": {}}]])
    assert message(error) == "an `image_url` content part needs its `image_url.url`"


# --- data URLs and checks


def test_data_url_decodes_and_refuses_past_the_byte_limit_and_bad_base64():
    data = image_bytes()
    assert decode_data_url(data_url(data), 1 << 20) == data
    with pytest.raises(ValidationError) as error:
        decode_data_url(data_url(b"x" * 3000), 1000, index=1)
    assert message(error).startswith("image 1 is larger than the limit of 1000 bytes. Given: ")
    with pytest.raises(ValidationError) as error:
        decode_data_url("data:image/png;base64,@@@@", 1000)
    assert message(error) == "image 0: the data: URL's base64 data does not decode"
    with pytest.raises(ValidationError):
        decode_data_url("data:image/png;base64", 1000)


@pytest.mark.parametrize(("fmt", "name"), [("PNG", "PNG"), ("JPEG", "JPEG"), ("WEBP", "WebP"), ("GIF", "GIF")])
def test_the_four_formats_are_read(fmt, name):
    checked = check_image(image_bytes(fmt, (10, 7), frames=3 if fmt == "GIF" else 1), ImageLimits())
    assert (checked.format, checked.width, checked.height) == (name, 10, 7)
    assert len(checked.digest) == 16


def test_every_image_limit_has_its_422():
    limits = ImageLimits(max_images=2, max_bytes=10_000, max_pixels=100)
    with pytest.raises(ValidationError) as error:
        check_count(3, limits)
    assert message(error) == "a request may carry at most 2 images. Given: 3"
    with pytest.raises(ValidationError) as error:
        check_image(image_bytes("PNG", (20, 10)), limits, index=1)
    assert message(error) == "image 1 has more than 100 pixels. Given: 20x10 = 200"
    with pytest.raises(ValidationError) as error:
        check_image(image_bytes("BMP"), limits)
    assert message(error) == "image 0 is BMP, not a format this server reads (PNG, JPEG, WebP, GIF)"
    with pytest.raises(ValidationError) as error:
        check_image(b"not an image at all", limits)
    assert message(error) == "image 0 is not an image this server reads (PNG, JPEG, WebP, GIF)"
    with pytest.raises(ValidationError) as error:
        check_image(image_bytes("PNG", (8, 8))[:-30], limits)
    assert message(error) == "image 0 does not decode: the PNG file is damaged"
    with pytest.raises(ValidationError) as error:
        check_image(b"\0" * 10_001, limits)
    assert message(error) == "image 0 is larger than the limit of 10000 bytes. Given: 10001 bytes"


# --- the URL fetch, from a server on 127.0.0.1


class Handler(http.server.BaseHTTPRequestHandler):
    routes: ClassVar[dict] = {}

    def do_GET(self):
        status, headers, body, delay = self.routes.get(self.path, (404, {}, b"", 0))
        if delay:
            time.sleep(delay)
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value.replace("PORT", str(self.server.server_address[1])))
        if "Connection" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client stopped at its limit
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    png = image_bytes()
    Handler.routes = {
        "/cat.png": (200, {"Content-Type": "image/png"}, png, 0),
        "/big.png": (200, {}, b"\0" * 5000, 0),
        # No Content-Length: the body is counted as it streams, until the server closes the connection.
        "/unsized": (200, {"Connection": "close"}, b"\0" * 5000, 0),
        "/slow.png": (200, {}, png, 1.5),
        "/to-local": (302, {"Location": "http://127.0.0.1:PORT/cat.png"}, b"", 0),
        "/to-ftp": (302, {"Location": "ftp://example.com/cat.png"}, b"", 0),
    }
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", png
    httpd.shutdown()


def fetch(url: str, **policy) -> bytes:
    return asyncio.run(read_image_bytes(url, FetchPolicy(**policy)))


def test_a_url_is_fetched(server):
    base, png = server
    assert fetch(f"{base}/cat.png") == png


def test_fetch_refusals(server):
    base, _ = server
    cases = {
        f"{base}/missing.png": f"image 0: fetching {base}/missing.png answered HTTP 404",
        f"{base}/big.png": "image 0 is larger than the limit of 1000 bytes. Given: 5000 bytes",
        f"{base}/to-local": "image 0: a redirect to 127.0.0.1 (127.0.0.1) is refused: not a public address",
        f"{base}/to-ftp": "image 0: a redirect to a URL that is not http(s) is not followed",
        "ftp://example.com/x.png": "image 0: only data:, http: and https: URLs are read. Given: 'ftp://example.com/x.png'",
    }
    for url, expected in cases.items():
        with pytest.raises(ValidationError) as error:
            fetch(url, max_bytes=1000)
        assert message(error) == expected
    with pytest.raises(ValidationError) as error:
        fetch(f"{base}/unsized", max_bytes=1000)
    assert message(error).startswith("image 0 is larger than the limit of 1000 bytes. Given: at least ")


def test_fetch_time_limit_and_switch(server):
    base, _ = server
    with pytest.raises(ValidationError) as error:
        fetch(f"{base}/slow.png", timeout_s=0.3)
    assert message(error) == "image 0: fetching it took longer than 0.3 s"
    with pytest.raises(ValidationError) as error:
        fetch(f"{base}/cat.png", enabled=False)
    assert message(error) == "image 0: this server does not fetch image URLs; send the image as a data: URL"


def test_public_addresses():
    assert is_public("8.8.8.8") and is_public("2606:4700::1111")
    for address in ["127.0.0.1", "10.1.2.3", "192.168.0.1", "169.254.169.254", "::1", "fd00::1", "::ffff:10.0.0.1",
                    "0.0.0.0", "100.64.0.1", "224.0.0.1"]:  # fmt: skip
        assert not is_public(address), address


# --- image tokens against transformers' processors


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory):
    from transformers import AutoProcessor

    folder = make_llava_folder(tmp_path_factory.mktemp("llava"))
    return folder, AutoProcessor.from_pretrained(folder)


def test_llava_tokens_match_its_processor(llava_folder):
    folder, processor = llava_folder
    tokens = image_tokens.for_model(folder)
    assert tokens is not None and tokens.marker == "<image>"
    pixels = [Image.open(io.BytesIO(image_bytes("PNG", (50, 40))))]
    expected = processor(text="A <image> here", images=pixels)["input_ids"][0]
    reader = ImageReader(tokens, ImageLimits(), FetchPolicy())
    prompt = asyncio.run(reader.chat("A <image> here", [ImageRef(data_url(image_bytes("PNG", (50, 40))))]))
    ids = processor.tokenizer(prompt.text)["input_ids"]
    assert ids == list(expected) and tokens.count(50, 40) == 16
    (located,) = reader.locate(ids, prompt.images)
    assert (located.start, located.length) == (ids.index(tokens.image_token_id), 16)


def test_qwen2_vl_tokens_follow_its_resize():
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    preprocessor = {"patch_size": 14, "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64}
    tokens = image_tokens._qwen2_vl({"model_type": "qwen2_vl", "image_token_id": 7}, {}, preprocessor)
    for size in [(512, 512), (640, 100), (30, 30), (1000, 333)]:
        grid = processor(images=[Image.new("RGB", size)], return_tensors="np")["image_grid_thw"][0]
        assert tokens.count(*size) == int(grid.prod()) // 4, size


def test_chat_markers_must_match_the_images(llava_folder):
    folder, _ = llava_folder
    reader = ImageReader(image_tokens.for_model(folder), ImageLimits(), FetchPolicy())
    with pytest.raises(ValidationError) as error:
        asyncio.run(reader.chat("<image><image>", [ImageRef(data_url(image_bytes()))]))
    assert message(error).startswith("the chat template wrote 2 image markers (<image>) for 1 images")


def test_a_text_model_takes_no_images(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert image_tokens.for_model(tmp_path) is None


def test_llava_crop_size_is_read_from_either_processor_file(tmp_path):
    """transformers 5 nests the image processor in processor_config.json; older folders have it beside."""
    vision = {"image_size": 32, "patch_size": 8}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": vision}))
    processor = {"patch_size": 8, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}
    crop = {"crop_size": {"height": 48, "width": 48}}
    (tmp_path / "processor_config.json").write_text(json.dumps(processor | {"image_processor": crop}))
    assert image_tokens.for_model(tmp_path).count(10, 10) == 36
    (tmp_path / "processor_config.json").write_text(json.dumps(processor))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"crop_size": {"height": 40, "width": 40}}))
    assert image_tokens.for_model(tmp_path).count(10, 10) == 25


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    from tests.fixtures import make_tokenizer

    folder = tmp_path_factory.mktemp("idefics3")
    tokenizer = make_tokenizer(folder)
    tags = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    special = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", *tags]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(images, tokenizer, image_seq_len=4)
    processor.save_pretrained(folder)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    config = {
        "model_type": "idefics3",
        "vision_config": {"image_size": 32, "patch_size": 8},
        "image_token_id": image_id,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder, processor


@pytest.mark.parametrize("size", [(40, 30), (30, 40), (64, 64), (20, 20), (100, 17), (33, 90), (1000, 999)])
def test_idefics3_tiles_match_its_processor(idefics3, size):
    folder, processor = idefics3
    tokens = image_tokens.for_model(folder)
    png = image_bytes("PNG", size)
    expected = processor(text="A <image> B", images=[Image.open(io.BytesIO(png))])["input_ids"][0]
    prompt = asyncio.run(
        ImageReader(tokens, ImageLimits(), FetchPolicy()).chat("A <image> B", [ImageRef(data_url(png))])
    )
    ids = processor.tokenizer(prompt.text)["input_ids"]
    assert ids == list(expected)
    assert ids.count(tokens.image_token_id) == tokens.count(*size)
