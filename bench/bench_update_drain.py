"""A model update on a serving llm_node: what the drain costs a goal that is running.

    .venv/bin/python bench/bench_update_drain.py [--tokens 128] [--repeat 3] [--json-out FILE]

An llm_node process serves the embedded SmolLM2-135M (INT4) from <models root>/current. A
goal of --tokens tokens (a JSON string schema forces the length) is running, its first
token streamed, when ~/update_model arrives with a signed copy of SmolLM2 after a simulated
fine-tune (bench_update.perturb: the last 4 layers). Measured per run:
- the running goal: its status (it must succeed with all its tokens, not be aborted) and
  how long the update waited for it (the drain, from the update's answer);
- the update: request -> answer, and that minus the drain (verify, install, swap, reload);
- a goal sent during the drain: it waits, then runs on the new model (its transcript's
  model); its time from send to result.
The update alternates between the two versions (each run swaps). Prints one JSON object
(also to --json-out) and a short table. The machine is shared and noisy: a single run's
numbers move; the median of --repeat runs is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Dict, List

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_update import perturb  # noqa: E402, I100 (bench/ helper modules sit next to this)
import rclpy  # noqa: E402, I100
from rclpy.executors import MultiThreadedExecutor  # noqa: E402

from edge_llm_msgs.msg import Transcript  # noqa: E402
from edge_llm_msgs.srv import UpdateModel  # noqa: E402
from edge_llm_ros.client import LLMClient  # noqa: E402
from edge_llm_ros.convert.default_model import ensure_default_model  # noqa: E402
from edge_llm_ros.node_process import NodeProcess  # noqa: E402
from edge_llm_ros.nodes import spin  # noqa: E402
from edge_llm_ros.update import manifest, signing  # noqa: E402
from edge_llm_ros.update.install import ModelsRoot  # noqa: E402

NODE_NAME = f'bench_update_drain_{os.getpid()}'
LONG_SCHEMA = '{"type": "string", "minLength": 5000}'


def signed_versions(work: pathlib.Path) -> List[pathlib.Path]:
    """Two signed SmolLM2 folders (the embedded one and a fine-tune-like change of it)."""
    private = work / 'fleet.key'
    signing.generate(private, work / 'fleet.pub')
    folders = []
    for name, layers in (('smollm2-a', 0), ('smollm2-b', 4)):
        folder = pathlib.Path(shutil.copytree(ensure_default_model(), work / name))
        for leftover in ('manifest.json', 'manifest.sig'):
            (folder / leftover).unlink(missing_ok=True)
        if layers:
            perturb(folder, layers, 0.25)
        # The transcripts name the model: tell the two versions apart.
        yaml_path = folder / 'model.yaml'
        yaml_path.write_text(''.join(f'name: {name}\n' if line.startswith('name:') else line
                                     for line in yaml_path.read_text().splitlines(True)))
        manifest.sign_folder(folder, signing.load_private(private))
        folders.append(folder)
    return folders


def one_update(client: LLMClient, update, transcripts: list, target: pathlib.Path,
               tokens: int) -> Dict[str, object]:
    streaming = threading.Event()
    running = client.generate('Count to one hundred.', max_tokens=tokens,
                              json_schema=LONG_SCHEMA,
                              on_feedback=lambda chunk: chunk.token_ids and streaming.set())
    if not streaming.wait(120):
        raise SystemExit('the running goal never streamed a token')
    t0 = time.monotonic()
    answer_box: list = []
    done = threading.Event()
    future = update.call_async(UpdateModel.Request(path=str(target)))
    future.add_done_callback(lambda f: (answer_box.append(f.result()), done.set()))
    time.sleep(0.05)
    sent = time.monotonic()
    late = client.generate('Say hi.', max_tokens=8)
    if not done.wait(300):
        raise SystemExit('~/update_model did not answer within 300 s')
    answered = time.monotonic() - t0
    answer = answer_box[0]
    outcome = running.result(timeout=120)
    late_outcome = late.result(timeout=120)
    late_s = time.monotonic() - sent
    drained = re.search(r'drained (\d+) running goal\(s\) in ([\d.]+) s', answer.message)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
            bytes(t.goal_id.uuid).hex() == late.goal_id for t in transcripts):
        time.sleep(0.05)
    late_model = next((t.model for t in transcripts
                       if bytes(t.goal_id.uuid).hex() == late.goal_id), '')
    drain_s = float(drained.group(2)) if drained else float('nan')
    return {'update_ok': bool(answer.success), 'message': answer.message,
            'running_status': outcome.status, 'running_tokens': outcome.completion_tokens,
            'drain_s': drain_s, 'update_s': answered, 'swap_s': answered - drain_s,
            'late_status': late_outcome.status, 'late_model': late_model,
            'late_send_to_result_s': late_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--tokens', type=int, default=128, help='tokens of the running goal')
    p.add_argument('--repeat', type=int, default=3)
    p.add_argument('--json-out', default='')
    args = p.parse_args(argv)
    work = pathlib.Path(tempfile.mkdtemp(prefix='bench_update_drain_'))
    node = None
    try:
        versions = signed_versions(work)
        root = ModelsRoot(work / 'models')
        trusted = signing.load_public(str(work / 'fleet.pub'))
        root.switch(root.install(versions[0], trusted).path)
        node = NodeProcess('llm_node', name=NODE_NAME, params={
            'autostart': True, 'model.path': str(root.current_link),
            'update.public_key': str(work / 'fleet.pub'),
            'update.models_root': str(root.path), 'kv.max_context': 1024})
        spin.init()
        client_node = rclpy.create_node(f'{NODE_NAME}_client')
        executor = MultiThreadedExecutor(num_threads=4)
        executor.add_node(client_node)
        spinning = spin.BackgroundSpin(executor)
        client = LLMClient(client_node, node.fqn)
        transcripts: list = []
        client_node.create_subscription(Transcript, f'{node.fqn}/transcript',
                                        transcripts.append, 50)
        update = client_node.create_client(UpdateModel, f'{node.fqn}/update_model')
        runs = []
        try:
            node.wait_until_active(client, timeout=600)
            if not update.wait_for_service(timeout_sec=60):
                raise SystemExit(f'{node.fqn}/update_model did not appear')
            client.generate('Hello', max_tokens=4).result(timeout=120)   # warm up
            for i in range(args.repeat):
                runs.append(one_update(client, update, transcripts, versions[(i + 1) % 2],
                                       args.tokens))
        finally:
            spin.close_client(spinning, executor, client_node, client)
    finally:
        code = node.stop() if node is not None else 0
        shutil.rmtree(work, ignore_errors=True)
    if code != 0:
        print(f'bench_update_drain: the node exited with {code}:\n{node.tail()}',
              file=sys.stderr)
    ok = all(r['update_ok'] and r['running_status'] == 'succeeded' and
             r['running_tokens'] == args.tokens and r['late_status'] == 'succeeded' and
             r['late_model'] == f'smollm2-{"ab"[(i + 1) % 2]}' for i, r in enumerate(runs))
    med = {key: statistics.median(r[key] for r in runs)
           for key in ('drain_s', 'update_s', 'swap_s', 'late_send_to_result_s')}
    report = {'model': 'SmolLM2-135M-Instruct INT4', 'running_goal_tokens': args.tokens,
              'runs': runs, 'median': med, 'all_goals_finished_on_their_model': ok,
              'cpu_count': os.cpu_count(), 'load_avg_1m': os.getloadavg()[0]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        pathlib.Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json_out).write_text(text + '\n')
    print(f'\n| SmolLM2-135M, a {args.tokens}-token goal running | median of {len(runs)} |')
    print('|---|---|')
    print(f"| drain (the running goal finishes) | {med['drain_s']:.2f} s |")
    print(f"| update request -> answer | {med['update_s']:.2f} s |")
    print(f"| of which verify + install + swap | {med['swap_s']:.2f} s |")
    late_s = med['late_send_to_result_s']
    print(f'| goal sent during the drain: send -> result | {late_s:.2f} s |')
    print(f'| every goal finished, on the model it was meant for | {ok} |')
    return 0 if ok and code == 0 else 1


if __name__ == '__main__':
    raise SystemExit(main())
