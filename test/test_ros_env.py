"""ros_env.sh gives a checkout's terminals one ROS_DOMAIN_ID; test.sh runs a random one.

The README's flow is llm_node in one terminal and `edge-llm ask` in another, both after
`source scripts/ros_env.sh`: they only find each other on the same domain.
"""
import os
import pathlib
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = 8


def _clean_env(**env) -> dict:
    """Return this environment without a domain (a new terminal), plus `env`."""
    base = {k: v for k, v in os.environ.items() if k not in ('ROS_DOMAIN_ID', 'EDGE_LLM_DOMAIN')}
    return {**base, **env}


def _domain(script: pathlib.Path, prelude: str = '', **env) -> int:
    """Source `script` in a fresh bash (ROS_DOMAIN_ID unset unless given); its domain."""
    proc = subprocess.run(['bash', '-c', f'{prelude}source "{script}"; echo "$ROS_DOMAIN_ID"'],
                          env=_clean_env(**env), capture_output=True, text=True, timeout=30,
                          check=True)
    return int(proc.stdout.strip())


def test_sourcing_again_or_in_another_shell_keeps_the_domain():
    script = ROOT / 'scripts' / 'ros_env.sh'
    domains = {_domain(script) for _ in range(RUNS)}
    assert len(domains) == 1, domains
    assert 1 <= domains.pop() <= 101
    # In the same shell too: sourcing twice keeps the exported value.
    proc = subprocess.run(['bash', '-c', f'source "{script}"; a=$ROS_DOMAIN_ID; unset '
                           f'ROS_DOMAIN_ID; source "{script}"; echo "$a $ROS_DOMAIN_ID"'],
                          env=_clean_env(), capture_output=True, text=True, timeout=30, check=True)
    first, second = proc.stdout.split()
    assert first == second


def test_a_domain_set_by_the_user_is_kept():
    assert _domain(ROOT / 'scripts' / 'ros_env.sh', ROS_DOMAIN_ID='42') == 42


def test_test_runs_get_random_domains_never_the_checkouts_own():
    script = ROOT / 'scripts' / 'ros_env.sh'
    own = _domain(script)
    runs = [_domain(script, 'EDGE_LLM_DOMAIN=run; ', ROS_DOMAIN_ID=str(own))
            for _ in range(RUNS)]
    assert own not in runs and all(1 <= d <= 101 for d in runs), (own, runs)
    assert len(set(runs)) > 1, runs


def test_test_sh_runs_pytest_on_its_own_random_domain(tmp_path):
    """scripts/test.sh in a copy of the checkout whose setup and python only report."""
    (tmp_path / 'scripts').mkdir()
    for name in ('test.sh', 'ros_env.sh'):
        shutil.copy(ROOT / 'scripts' / name, tmp_path / 'scripts' / name)
    (tmp_path / 'scripts' / 'setup.sh').write_text('exit 0\n')
    (tmp_path / 'scripts' / 'arm64_rootfs.sh').write_text('exit 0\n')
    python = tmp_path / '.venv' / 'bin' / 'python'
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "pytest domain $ROS_DOMAIN_ID"\n')
    python.chmod(0o755)
    own = _domain(tmp_path / 'scripts' / 'ros_env.sh')
    seen = []
    for _ in range(RUNS):
        # The terminal that runs the tests sourced ros_env.sh: its domain is the checkout's.
        proc = subprocess.run(['bash', str(tmp_path / 'scripts' / 'test.sh')],
                              env=_clean_env(ROS_DOMAIN_ID=str(own)),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        seen.append(int(proc.stdout.split('pytest domain ')[1].split()[0]))
    assert own not in seen and len(set(seen)) > 1, (own, seen)


def test_an_installed_ros_that_setup_built_against_is_sourced_in_new_terminals(tmp_path):
    """setup.sh records the installed ROS's setup.bash; ros_env.sh sources it (under set -u)."""
    venv = tmp_path / 'venv'
    (venv / '.edge_llm_stamps').mkdir(parents=True)
    ros = tmp_path / 'opt_ros' / 'humble'
    ros.mkdir(parents=True)
    # Like ROS's own scripts, it reads a variable that may be unset.
    (ros / 'setup.bash').write_text(
        f'export ROS_DISTRO=humble${{UNSET_BY_DESIGN:-}}\nexport AMENT_PREFIX_PATH={ros}\n')
    (venv / '.edge_llm_stamps' / 'ros_setup').write_text(f'{ros / "setup.bash"}\n')
    script = ROOT / 'scripts' / 'ros_env.sh'
    show = 'echo "$ROS_DISTRO|$AMENT_PREFIX_PATH|${LD_LIBRARY_PATH%%:*}"'
    env = {k: v for k, v in _clean_env(EDGE_LLM_VENV=str(venv)).items()
           if k not in ('AMENT_PREFIX_PATH', 'ROS_DISTRO', 'LD_LIBRARY_PATH')}
    proc = subprocess.run(['bash', '-c', f'set -u; source "{script}"; source "{script}"; {show}'],
                          env=env, capture_output=True, text=True, timeout=30, check=True)
    # The venv (edge_llm_msgs) overlays the ROS install, once however often it is sourced.
    assert proc.stdout.strip() == f'humble|{venv}:{ros}|{venv}/lib', proc.stderr
    # The wheels path records no setup.bash: nothing is sourced.
    (venv / '.edge_llm_stamps' / 'ros_setup').write_text('\n')
    proc = subprocess.run(['bash', '-c', f'source "{script}"; {show}'], env=env,
                          capture_output=True, text=True, timeout=30, check=True)
    assert proc.stdout.strip().startswith('||'), proc.stdout
