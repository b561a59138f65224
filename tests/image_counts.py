"""How many image pads each image of a /generate expands to, for tests/fake_sglang.py: the checkpoint's own image
processor's grid / merge^2, as stock SGLang counts them.

Importing transformers' image processor costs a fresh process ~5 CPU s (torch, torchvision), which each fake server
that saw an image paid. tests/conftest.py serves the counts from a thread of each pytest process instead (imports
done once, a processor kept a checkpoint) and names its socket in FAKE_SGLANG_IMAGES, which the fake servers it
starts inherit; a fake server without the variable (run by hand) loads the processor itself. The socket is an
abstract unix one (Linux): no file to remove, gone with the process, and no process of its own to leak.
"""
import base64
import io
import json
import socket
import threading

IMAGES_SOCKET = "FAKE_SGLANG_IMAGES"  # the environment variable naming the service's socket
ANSWER = "fake-sglang-images-answer"  # the name of a thread that answers one asker


def decode_image(uri):
    from PIL import Image
    return Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))


def load_image_processor(model_path):
    from transformers import AutoImageProcessor  # alone: the tokenizer would take seconds more
    return AutoImageProcessor.from_pretrained(model_path)


def processor_counts(ip, uris):
    """Pads each image expands to: its grid from the checkpoint's own image processor `ip` / merge^2."""
    grid = ip(images=[decode_image(u) for u in uris], return_tensors="pt")["image_grid_thw"]
    return [int(g.prod()) // ip.merge_size ** 2 for g in grid]


def serve_image_counts(name):
    """Answer ask_image_counts on the abstract unix socket `name` from daemon threads of this process -> the
    listening socket (close it to stop)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen()
    processors = {}  # model_path -> its image processor
    lock = threading.Lock()

    def count(ask):
        try:
            with lock:
                if ask["model_path"] not in processors:
                    processors[ask["model_path"]] = load_image_processor(ask["model_path"])
                return {"counts": processor_counts(processors[ask["model_path"]], ask["images"])}
        except Exception as e:  # noqa: BLE001 - the asking fake server raises it
            return {"error": f"{type(e).__name__}: {e}"}

    def answer(conn):
        try:
            with conn, conn.makefile("rwb") as f:
                line = f.readline()
                if line:  # else the fake server died before it asked
                    f.write(json.dumps(count(json.loads(line))).encode() + b"\n")
        except OSError:  # it died before the answer (a test killed it mid-request): nobody to tell
            pass

    def accept():
        while True:
            try:
                conn = listener.accept()[0]
            except OSError:  # closed: stop
                return
            # a thread a connection: a fake server killed mid-request holds up no other
            threading.Thread(target=answer, args=(conn,), daemon=True, name=ANSWER).start()
    threading.Thread(target=accept, daemon=True, name="fake-sglang-images").start()
    return listener


def ask_image_counts(name, model_path, uris):
    """processor_counts of `uris` by model_path's processor, from the service on the abstract unix socket `name`."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect("\0" + name)
            with s.makefile("rwb") as f:
                f.write(json.dumps({"model_path": model_path, "images": uris}).encode() + b"\n")
                f.flush()
                reply = json.loads(f.readline() or "{}")
    except OSError as e:
        raise RuntimeError(f"{IMAGES_SOCKET}={name}: no image service answers ({e})") from e
    if "counts" not in reply:
        raise RuntimeError(f"{IMAGES_SOCKET}={name}: the image service failed: {reply.get('error', 'no answer')}")
    return reply["counts"]
