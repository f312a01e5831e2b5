"""`edge-llm ask "..."` / `ros2 run edge_llm_ros ask "..."`: one prompt to a running llm_node.

Prints the answer as it streams, then one line of timings on stderr. Ctrl-C cancels the goal
and prints the partial answer. Exit status: 0 answered, 1 refused or failed, 130 cancelled.

`--video FILE --fps 2` sends a clip (a Qwen-VL model; --max-frames caps it) with the images.
`--window 3 --perception /perception` asks instead about the last 3 seconds the perception
node's camera saw: llm_node takes that node's time window (sampled at --fps, at most
--max-frames, default 8) as the clip ("what just happened?").
`--image FILE` (repeatable) sends images to a vision model: they are decoded here into one
slot of a pool this command owns (its socket in the same EDGE_LLM_IPC_DIR as the node's), and
the goal carries only their handles; llm_node maps the slot while the goal runs. The pool
closes when the answer is in. `--draw OUT.png` (one image, a grounding model such as
Qwen2.5-VL) draws the answer's boxes and points on that image; `--max-image-tokens N` raises
or lowers the node's cap on the tokens of one image.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence, TextIO

import numpy as np
import rclpy
from rclpy.executors import SingleThreadedExecutor

from edge_llm_ros.client import (GenerationOutcome, LLMClient, LLMClientError,
                                 NodeNotActiveError, VideoWindow)
from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.ipc.errors import IpcError
from edge_llm_ros.nodes import spin
from edge_llm_ros.nodes.handles import image_pool
from edge_llm_ros.runtime.media import MEDIA_MARKER
from edge_llm_ros.runtime.video_file import DEFAULT_MAX_FRAMES, read_clip

EXIT_OK, EXIT_FAILED, EXIT_CANCELLED = 0, 1, 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('prompt', help='the question or instruction')
    parser.add_argument('--server', default='/llm_node',
                        help='fully qualified name of the llm_node (default: /llm_node)')
    parser.add_argument('--system', default='', help="system prompt (default: the node's)")
    parser.add_argument('--max-tokens', type=int, default=0,
                        help="completion tokens (default 0: the node's max_tokens)")
    parser.add_argument('--temperature', type=float, default=None,
                        help="sampling temperature (default: the node's; 0 = greedy)")
    parser.add_argument('--seed', type=int, default=None, help='sampling seed')
    parser.add_argument('--session', default='',
                        help='continue this conversation: the node remembers its turns')
    parser.add_argument('--json-schema', default='',
                        help='constrain the answer to JSON of this schema (schema as JSON text)')
    parser.add_argument('--image', action='append', default=[], metavar='FILE',
                        help='an image (PNG/JPEG/...) for a vision model (repeatable); it goes '
                             f'where the prompt has {MEDIA_MARKER}, else ahead of the text')
    parser.add_argument('--video', default='', metavar='FILE',
                        help='a video file for a Qwen-VL model: frames sampled at --fps (one '
                             f'{MEDIA_MARKER}, after those of --image, else ahead of the text)')
    parser.add_argument('--fps', type=float, default=2.0,
                        help='frames per second taken from --video (0: every frame)')
    parser.add_argument('--max-frames', type=int, default=None,
                        help=f'most frames taken from --video, from its start (default '
                             f'{DEFAULT_MAX_FRAMES}), or from --window (default 8)')
    parser.add_argument('--window', type=float, default=None, metavar='SECONDS',
                        help="a Qwen-VL model: the last SECONDS of --perception's camera as "
                             f'the clip (one {MEDIA_MARKER}, as --video), sampled at --fps')
    parser.add_argument('--perception', default='/perception', metavar='NODE',
                        help='the perception node whose time window --window names (it runs '
                             'with window.seconds > 0; default /perception)')
    parser.add_argument('--max-image-tokens', type=int, default=0, metavar='N',
                        help="most tokens one image may take (default 0: the node's "
                             'vision.max_image_tokens)')
    parser.add_argument('--draw', default='', metavar='OUT',
                        help="with one --image: draw the answer's boxes and points (a grounding "
                             'model: Qwen2.5-VL) on it and save the picture to OUT (PNG, JPEG)')
    parser.add_argument('--raw', action='store_true',
                        help='feed the prompt as is: no chat template, special tokens parsed, '
                             f'{MEDIA_MARKER} where each image goes')
    parser.add_argument('--wait', type=float, default=30.0,
                        help='seconds to wait for the node to be active (default 30)')
    parser.add_argument('--timeout', type=float, default=600.0,
                        help='seconds to wait for the answer (default 600)')


def format_timings(outcome: GenerationOutcome) -> str:
    t = outcome.timings
    cached = f' ({t.cached_prompt_tokens} cached)' if t.cached_prompt_tokens else ''
    return (f'[{outcome.finish_reason}: {outcome.prompt_tokens} prompt tokens{cached}, '
            f'{outcome.completion_tokens} generated; TTFT {t.time_to_first_token_s * 1e3:.0f} ms'
            f', prefill {t.prefill_tokens_per_second:.0f} tok/s, decode '
            f'{t.decode_tokens_per_second:.1f} tok/s, queue {t.queue_wait_s * 1e3:.0f} ms, '
            f'total {t.total_s:.2f} s]')


def decode_images(paths: Sequence[str]) -> List[np.ndarray]:
    """RGB [H, W, 3] uint8 of each image file (ImageInputError names a bad one)."""
    if not paths:
        return []
    from edge_llm_ros.runtime.image_file import decode_image
    return [decode_image(path, f'--image {path}') for path in paths]


def prompt_with_markers(prompt: str, n_images: int, raw: bool) -> str:
    """Put one media marker per image ahead of a chat prompt that has none (as generate does).

    A raw prompt is sent as written: it must place its markers itself.
    """
    if n_images and not raw and MEDIA_MARKER not in prompt:
        return MEDIA_MARKER * n_images + '\n' + prompt
    return prompt


def draw_answer(outcome: GenerationOutcome, pixels: np.ndarray, path: str, err: TextIO) -> None:
    """Save `pixels` with the outcome's detections drawn to `path` (--draw); say what was done."""
    from edge_llm_ros.vision.draw import Box, save_drawing
    if not outcome.detections:
        print(f'ask: the answer holds no boxes or points: {path} not written', file=err)
        return
    boxes = [Box(d.bbox.center.position.x, d.bbox.center.position.y, d.bbox.size_x,
                 d.bbox.size_y, d.results[0].class_id if d.results else '')
             for d in outcome.detections]
    print(f'ask: {len(boxes)} detection(s) drawn to {save_drawing(pixels, boxes, path)}',
          file=err)


def check_draw(args: argparse.Namespace, n_images: int) -> str:
    """Return why --draw cannot be done with these arguments ('' when it can)."""
    if getattr(args, 'draw', '') and n_images != 1:
        return f'--draw needs exactly one --image (got {n_images}): boxes are drawn on it'
    return ''


def stream_answer(client: LLMClient, args: argparse.Namespace, out: TextIO = sys.stdout,
                  err: TextIO = sys.stderr, images: Sequence = (),
                  drawn_on: Optional[np.ndarray] = None, clip=None) -> int:
    """Send the goal, print deltas as they come; Ctrl-C cancels. Returns the exit status.

    images: TensorHandle messages of the goal's images (see image_pool), then its clip's
    frames when `clip` (runtime.media.VideoClip: its timestamps and fps) is given; drawn_on:
    the pixels --draw draws the answer's detections on.
    """
    frames = list(images[len(images) - len(clip.frames):]) if clip is not None else []
    images = list(images[:len(images) - len(frames)])
    seconds = getattr(args, 'window', None)
    window = (VideoWindow(args.perception, seconds, args.max_frames or 0)
              if seconds is not None else None)
    sampling = {}
    if args.temperature is not None:
        sampling['temperature'] = args.temperature
    if args.seed is not None:
        sampling['seed'] = args.seed
    raw = bool(getattr(args, 'raw', False))
    handle = client.generate(prompt_with_markers(args.prompt,
                                                 len(images) + bool(frames or window), raw),
                             system_prompt=args.system, max_tokens=args.max_tokens,
                             session_id=args.session,
                             json_schema=getattr(args, 'json_schema', ''),
                             images=list(images), raw_prompt=raw,
                             max_image_tokens=int(getattr(args, 'max_image_tokens', 0) or 0),
                             video_frames=frames,
                             video_timestamps=clip.timestamps if clip is not None else (),
                             video_fps=(clip.fps if clip is not None else
                                        args.fps if window is not None else 0.0),
                             video_window=window, **sampling)
    cancelled = False
    try:
        for delta in handle.stream(timeout=args.timeout):
            out.write(delta)
            out.flush()
    except (LLMClientError, TimeoutError) as exc:
        print(f'ask: {exc}', file=err)
        return EXIT_FAILED
    except KeyboardInterrupt:
        cancelled = True
        print('\n[Ctrl-C: cancelling]', file=err, flush=True)
        handle.cancel()
        spin.arm()   # a second Ctrl-C stops waiting for the cancelled goal's result
    try:
        outcome = handle.result(timeout=args.timeout)
    except (LLMClientError, TimeoutError) as exc:
        print(f'\nask: {exc}', file=err)
        return EXIT_FAILED
    if cancelled:
        out.write('\n--- partial answer ---\n' + outcome.text)
    out.write('\n')
    out.flush()
    print(format_timings(outcome), file=err)
    if outcome.error_message:
        print(f'ask: {outcome.status}: {outcome.error_message}', file=err)
    if outcome.ok and getattr(args, 'draw', '') and drawn_on is not None:
        draw_answer(outcome, drawn_on, args.draw, err)
    if outcome.finish_reason == 'cancelled':
        return EXIT_CANCELLED
    return EXIT_OK if outcome.ok else EXIT_FAILED


def wait_for_node(client: LLMClient, wait_s: float, err: TextIO = sys.stderr) -> bool:
    """Wait until the llm_node is active and its action server known; say why not."""
    try:
        client.wait_until_active(timeout=wait_s)
    except NodeNotActiveError as exc:
        print(f'ask: {exc}', file=err)   # says what to check: name, domain, lifecycle state
        return False
    if not client.wait_for_server(timeout=max(wait_s, 5.0)):
        print(f'ask: {client.server} is active but its action server {client.server}/generate '
              f'was not discovered within {max(wait_s, 5.0):.0f} s', file=err)
        return False
    return True


def run(args: argparse.Namespace) -> int:
    try:   # before anything connects: a bad file is the first thing to say
        pixels = decode_images(getattr(args, 'image', ()))
        if getattr(args, 'video', '') and getattr(args, 'window', None) is not None:
            raise InvalidRequestError('give --video FILE or --window SECONDS, not both: a goal '
                                      'takes one clip')
        clip = (read_clip(args.video, args.fps, DEFAULT_MAX_FRAMES if args.max_frames is None
                          else args.max_frames, f'--video {args.video}')
                if getattr(args, 'video', '') else None)
    except InvalidRequestError as exc:
        print(f'ask: {exc}', file=sys.stderr)
        return EXIT_FAILED
    problem = check_draw(args, len(pixels))
    if problem:
        print(f'ask: {problem}', file=sys.stderr)
        return EXIT_FAILED
    # Our own Ctrl-C handling (nodes/spin.py): KeyboardInterrupt reaches the main thread, the
    # context stays up so the cancel request can still be sent.
    spin.init()
    node = rclpy.create_node('edge_llm_ask', start_parameter_services=False)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    spinning = spin.BackgroundSpin(executor)
    client: Optional[LLMClient] = None
    try:
        client = LLMClient(node, args.server)
        if not wait_for_node(client, args.wait):
            return EXIT_FAILED
        frames = list(clip.frames) if clip is not None else []
        with image_pool(pixels + frames, f'edge_llm_ask_{os.getpid()}') as images:
            return stream_answer(client, args, images=images,
                                 drawn_on=pixels[0] if pixels else None, clip=clip)
    except IpcError as exc:   # the images' pool could not be opened
        print(f'ask: cannot share the images with {args.server}: {exc}', file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_CANCELLED
    finally:
        spin.ignore_signals()
        spinning.stop()
        spin.shutdown_executor(executor, timeout=1.0)
        if client is not None:
            client.destroy()
        node.destroy_node()
        rclpy.try_shutdown()


def main(argv: Optional[List[str]] = None) -> int:
    """Console script `ask` (ROS arguments after --ros-args are ignored)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if '--ros-args' in argv:
        argv = argv[:argv.index('--ros-args')]
    parser = argparse.ArgumentParser(prog='ask', description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == '__main__':
    sys.exit(main())
