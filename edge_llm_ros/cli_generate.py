"""`edge-llm generate "prompt"`: stream a completion to stdout, timings to stderr.

With --json, stdout gets one JSON object once the generation ends instead of the stream
(see result_json), for scripts and for parity checks against llama.cpp.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Any, Dict

from edge_llm_ros.bringup.parameters import parse_lora_adapters
from edge_llm_ros.errors import EngineError, InvalidRequestError
from edge_llm_ros.runtime.image_file import decode_image
from edge_llm_ros.runtime.media import MEDIA_MARKER
from edge_llm_ros.runtime.native_ops import KERNEL_CHOICES
from edge_llm_ros.runtime.speculative_config import SPECULATIVE_MODES, SpeculativeConfig
from edge_llm_ros.runtime.types import GenerationRequest, GenerationResult, SamplingConfig
from edge_llm_ros.runtime.video_file import DEFAULT_MAX_FRAMES, read_clip
from edge_llm_ros.serving.engine import Engine, EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('prompt', help='the user message (with --raw: the whole prompt)')
    parser.add_argument('--image', action='append', default=[], metavar='FILE',
                        help='an image (PNG/JPEG) for a converted VLM (repeatable); it goes '
                             f'where the prompt has {MEDIA_MARKER}, else ahead of the text')
    parser.add_argument('--video', default='', metavar='FILE',
                        help='a video file for a Qwen-VL model: frames sampled at --fps; its '
                             f'{MEDIA_MARKER} is after those of --image, else ahead of text')
    parser.add_argument('--fps', type=float, default=2.0,
                        help='frames per second taken from --video (0: every frame)')
    parser.add_argument('--max-frames', type=int, default=DEFAULT_MAX_FRAMES,
                        help='most frames taken from --video, from its start (each 2 frames '
                             'are one image of tokens)')
    parser.add_argument('--raw', action='store_true',
                        help='feed the prompt as is: no chat template, special tokens parsed, '
                             f'{MEDIA_MARKER} where each image goes (as llama.cpp takes it)')
    parser.add_argument('--model', default='',
                        help='converted model folder (default: the embedded SmolLM2)')
    parser.add_argument('--system', default='', help='system prompt')
    parser.add_argument('--max-tokens', type=int, default=256)
    parser.add_argument('--temperature', type=float, default=0.0, help='0 = greedy')
    parser.add_argument('--top-p', type=float, default=1.0)
    parser.add_argument('--top-k', type=int, default=0)
    parser.add_argument('--seed', type=int, default=None)
    parser.add_argument('--stop', action='append', default=[], help='stop string (repeatable)')
    parser.add_argument('--threads', type=int, default=0, help='intra-op threads (0 = default)')
    parser.add_argument('--max-context', type=int, default=2048)
    parser.add_argument('--json-schema', default='', metavar='FILE',
                        help='constrain the output to JSON valid against this schema file')
    parser.add_argument('--kernel', default='auto', choices=KERNEL_CHOICES,
                        help='CPU kernels of a kquant model (default: the best this CPU has)')
    parser.add_argument('--speculative', default='off', choices=SPECULATIVE_MODES,
                        help='speculative decoding (exact; docs/speculative.md): prompt_lookup, '
                             'draft (--draft-model), auto')
    parser.add_argument('--max-draft', type=int, default=6,
                        help='tokens drafted per pass, at most')
    parser.add_argument('--draft-model', default='', metavar='FOLDER',
                        help='converted model with the same tokenizer that drafts')
    parser.add_argument('--verbose', action='store_true',
                        help='print the model, its weight format and the kernels that run')
    parser.add_argument('--lora', action='append', default=[], metavar='PATH[@SCALE]',
                        help='a LoRA adapter for this generation (a llama.cpp LoRA GGUF or a '
                             'PEFT folder) at SCALE (default 1.0); repeatable')
    parser.add_argument('--json', action='store_true',
                        help='print one JSON object instead of the stream: text, token_ids, '
                             'stop_reason, error, prompt_tokens, completion_tokens, model, '
                             'timings (as runtime.types.Timings names them)')


def lora_arguments(items) -> tuple:
    """Return --lora PATH[@SCALE] items as (name, path, scale), named after their files."""
    named = []
    for i, item in enumerate(items):
        stem = pathlib.Path(item.rpartition('@')[0] or item).stem or f'lora{i}'
        named.append(f'{stem}{i}={item}')
    try:
        return parse_lora_adapters(named)
    except ValueError as exc:
        raise InvalidRequestError(f'--lora: {exc}') from None


def result_json(result: GenerationResult, model: str) -> Dict[str, Any]:
    """Return the --json object of one generation (its keys are those the --json help names)."""
    return {'text': result.text, 'token_ids': [int(i) for i in result.token_ids],
            'stop_reason': result.stop_reason.value, 'error': result.error,
            'prompt_tokens': result.prompt_tokens,
            'completion_tokens': result.completion_tokens, 'model': model,
            'timings': dataclasses.asdict(result.timings)}


def run(args: argparse.Namespace) -> int:
    schema = ''
    if args.json_schema:
        try:
            with open(args.json_schema, encoding='utf-8') as f:
                schema = f.read()
        except OSError as e:
            print(f'edge-llm generate: cannot read --json-schema {args.json_schema}: {e}',
                  file=sys.stderr)
            return 2
    try:
        adapters = lora_arguments(args.lora)
        converted = adapters
        if adapters:   # each converted once, cached beside the model (the converter: only here)
            from edge_llm_ros.convert.lora import convert_adapters
            converted = convert_adapters(adapters, args.model)
        engine = Engine(EngineConfig(model_dir=args.model, intra_op_threads=args.threads,
                                     max_context=args.max_context, kernel=args.kernel,
                                     lora_adapters=converted, lora_max_per_goal=max(
                                         len(adapters), 1),
                                     speculative=SpeculativeConfig(
                                         mode=args.speculative, max_draft=args.max_draft,
                                         draft_model=args.draft_model)))
        if args.verbose:
            info = engine.model_info()
            print(f'[{engine.model_name}] {engine.model_dir}: {info["quantization"]}; kernel '
                  f'{engine.kernel}; providers {", ".join(engine.providers)}', file=sys.stderr)
        images = [decode_image(path, f'--image {path}') for path in args.image]
        if args.video:
            images.append(read_clip(args.video, args.fps, args.max_frames,
                                    f'--video {args.video}'))
        prompt = args.prompt
        if images and not args.raw and MEDIA_MARKER not in prompt:
            prompt = MEDIA_MARKER * len(images) + '\n' + prompt
        request = GenerationRequest(
            prompt=prompt, system_prompt=args.system, max_tokens=args.max_tokens,
            images=images, use_chat_template=not args.raw,
            stop=tuple(args.stop), json_schema=schema,
            sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p,
                                    top_k=args.top_k, seed=args.seed),
            lora={name: scale for name, _, scale in adapters})
        generation = engine.generate(request)
    except InvalidRequestError as e:
        print(f'edge-llm generate: invalid request: {e}', file=sys.stderr)
        return 2
    except EngineError as e:
        print(f'edge-llm generate: {e}', file=sys.stderr)
        return 1
    try:
        for event in generation:
            if not args.json:
                sys.stdout.write(event.text_delta)
                sys.stdout.flush()
    except KeyboardInterrupt:
        generation.cancel()
        print('\n[interrupted]', file=sys.stderr)
        return 130
    result = generation.result
    if args.json:
        print(json.dumps(result_json(result, engine.model_name)))
        if result.error:
            print(f'edge-llm generate: generation failed: {result.error}', file=sys.stderr)
        return 1 if result.error else 0
    sys.stdout.write('\n')
    t = result.timings
    print(f'[{engine.model_name}] {result.stop_reason.value}: prompt {result.prompt_tokens} '
          f'tokens ({t.cached_prompt_tokens} cached), {result.completion_tokens} generated; '
          f'TTFT {t.time_to_first_token_s * 1000:.0f} ms, prefill '
          f'{t.prefill_tokens_per_second:.0f} tok/s, decode {t.decode_tokens_per_second:.1f} '
          f'tok/s', file=sys.stderr)
    if t.draft_passes:
        print(f'[{engine.model_name}] speculative: {t.accepted_draft_tokens}/{t.draft_tokens} '
              f'drafted tokens accepted in {t.draft_passes} verify passes; '
              f'{result.completion_tokens / max(t.decode_steps + 1, 1):.2f} tokens per model '
              'call', file=sys.stderr)
    if result.error:
        print(f'edge-llm generate: generation failed: {result.error}', file=sys.stderr)
        return 1
    return 0
