"""The Dockerfiles pin what they install, run as a fixed non-root user and carry no credentials;
images/build.sh tags every image from components/images.py."""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile*"))
SECRET_WORDS = re.compile(r"(SECRET|PASSWORD|TOKEN|ACCESS_KEY|API_KEY|CREDENTIAL)", re.I)


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def pip_specs(run_args: str) -> list[str]:
    """Package arguments of every `pip install` in one RUN line (options and -r files excluded)."""
    specs = []
    for command in re.split(r"&&|;", run_args):
        words = command.split()
        if "pip" not in words[:2] or "install" not in words:
            continue
        args = words[words.index("install") + 1:]
        skip = False
        for word in args:
            if skip:
                skip = False
            elif word in ("-r", "--requirement", "-c", "--constraint", "--find-links"):
                skip = True
            elif word.startswith("/wheels/"):  # the wheelhouse images/build.sh resolves with -c requirements/cpu.txt
                continue
            elif not word.startswith("-") and word != ".":
                specs.append(word)
    return specs


def requirement_files(dockerfile: Path) -> list[Path]:
    return [ROOT / src for op, args in instructions(dockerfile) if op == "COPY"
            for src in args.split()[:-1] if src.endswith(".txt")]


def test_every_image_is_there():
    assert {d.parent.name for d in DOCKERFILES} >= {"trainer", "tools", "mlflow"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name + p.name[len("Dockerfile"):])
def test_base_image_is_pinned(dockerfile):
    bases = [args.split()[0] for op, args in instructions(dockerfile) if op == "FROM"]
    assert bases
    for base in bases:
        name = base.rsplit("/", 1)[-1]
        assert "@sha256:" in base or (":" in name and not name.endswith(":latest")), base


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name + p.name[len("Dockerfile"):])
def test_every_pip_package_is_pinned(dockerfile):
    specs = [s for op, args in instructions(dockerfile) if op == "RUN" for s in pip_specs(args)]
    paths = requirement_files(dockerfile)
    if any("/wheels/" in args for op, args in instructions(dockerfile) if op == "RUN"):
        paths.append(ROOT / "requirements" / "cpu.txt")  # the wheelhouse's constraints (images/build.sh)
    for path in paths:
        assert path.is_file(), path
        specs += [line.split("#")[0].strip() for line in path.read_text().splitlines()
                  if line.split("#")[0].strip()]
    assert specs, "installs nothing?"
    unpinned = [s for s in specs if not re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[A-Za-z0-9_,\-]+\])?==[^=<>!~*,]+", s)]
    assert not unpinned, unpinned


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name + p.name[len("Dockerfile"):])
def test_runs_as_fixed_non_root_user(dockerfile):
    users = [args.strip() for op, args in instructions(dockerfile) if op == "USER"]
    assert users, "no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users[-1]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name + p.name[len("Dockerfile"):])
def test_no_credentials_baked_in(dockerfile):
    for op, args in instructions(dockerfile):
        if op in ("ENV", "ARG"):
            names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args) or [args.split()[0]]
            assert not [n for n in names if SECRET_WORDS.search(n)], f"{op} {args}"


def test_trainer_image_has_the_gpu_stack_and_the_source_tree():
    text = (IMAGES / "trainer" / "Dockerfile").read_text()
    reqs = (IMAGES / "trainer" / "requirements.txt").read_text()
    for package in ("torch==2.14", "vllm==0.33", "kfp==", "accelerate=="):
        assert re.search(rf"^{re.escape(package)}", reqs, re.M), package
    assert "deepspeed==" in text and "ARG ALIGNFLOW_GIT_SHA" in text
    assert re.search(r"pip install .*--no-deps \.$", text, re.M), "alignflow is not installed from the source tree"
    assert "COPY trainer" in text


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_trainer_images_compile_the_source_tree_they_run_from(name):
    """PYTHONDONTWRITEBYTECODE is set, so the tree the tasks import (WORKDIR) is compiled at build time, after it
    is copied in (scripts/setup.sh does the same for a checkout)."""
    text = (IMAGES / "trainer" / name).read_text()
    assert "PYTHONDONTWRITEBYTECODE=1" in text
    compiled = text.index("RUN python -m compileall -q trainer components pipelines")
    assert compiled > text.index("COPY pipelines ./pipelines") > text.index("WORKDIR /opt/alignflow")


def test_cpu_trainer_image_installs_the_resolved_cpu_set_from_a_bind_mount():
    """The CPU image takes its packages from the wheelhouse build.sh resolves against requirements/cpu.txt,
    through a bind mount (never a layer: no COPY or ADD of it), and bakes the revision in last."""
    dockerfile = IMAGES / "trainer" / "Dockerfile.cpu"
    ops = instructions(dockerfile)
    assert ops[0] == ("FROM", "debian:bookworm-slim")
    runs = [args for op, args in ops if op == "RUN"]
    assert any("--mount=type=bind,source=images/.wheels/trainer-cpu" in r and "--no-index" in r for r in runs)
    assert not [args for op, args in ops if op in ("COPY", "ADD") and ".wheels" in args]
    build = (IMAGES / "build.sh").read_text()
    assert "-c requirements/cpu.txt" in build and ".[mlflow,pipeline,s3,deepspeed,cpu,gguf]" in build
    # the git revision comes after every install, so a new commit rebuilds no dependency layer
    names = [op for op, _ in ops]
    assert names.index("ARG") > max(i for i, op in enumerate(names) if op in ("RUN", "COPY"))
    assert ("USER", "10001:10001") in ops


def test_dockerignore_keeps_secrets_and_outputs_out_of_the_context():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*", "everything is excluded first, then what the builds read"
    assert not [r for r in rules if r.startswith("!") and any(w in r for w in (".git", ".venv", "output"))]


def test_tools_image_has_the_clients():
    reqs = (IMAGES / "tools" / "requirements.txt").read_text()
    for package in ("kfp==", "mlflow-skinny==", "s3fs"):
        assert package in reqs


def test_build_sh_tags_from_components_images(tmp_path):
    """Run build.sh with a fake docker and check the tags it builds and pushes."""
    fake = tmp_path / "docker"
    log = tmp_path / "calls"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    fake.chmod(0o755)
    pip = tmp_path / "pip"  # the wheelhouse step: logged, not run
    pip.write_text(f"#!/bin/sh\necho pip \"$@\" >> {log}\n")
    pip.chmod(0o755)
    env = {**os.environ, "DOCKER": str(fake), "PIP": str(pip), "ALIGNFLOW_WHEELHOUSE": str(tmp_path / "wheels"), "ALIGNFLOW_IMAGE_REGISTRY": "reg.example/team",
           "ALIGNFLOW_IMAGE_TAG": "9.9.9-test", "PYTHONPATH": str(ROOT)}
    env.pop("ALIGNFLOW_TRAINER_IMAGE", None)
    env.pop("ALIGNFLOW_TOOLS_IMAGE", None)
    subprocess.run(["bash", str(IMAGES / "build.sh")], check=True, env=env, cwd=tmp_path)
    calls = [c.removeprefix("buildx ") for c in log.read_text().splitlines() if not c.startswith("image inspect")]
    built = [c.split("--tag ")[1].split()[0] for c in calls if c.startswith("build")]
    pushed = [c.split()[1] for c in calls if c.startswith("push")]
    assert built == ["reg.example/team/trainer:9.9.9-test", "reg.example/team/tools:9.9.9-test",
                     "reg.example/team/mlflow:9.9.9-test"]
    assert pushed == built
    assert all("ALIGNFLOW_GIT_SHA=" in c for c in calls if c.startswith("build"))


def test_build_sh_cpu_builds_the_cpu_trainer_and_mlflow_images(tmp_path):
    fake = tmp_path / "docker"
    log = tmp_path / "calls"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    fake.chmod(0o755)
    pip = tmp_path / "pip"
    pip.write_text(f"#!/bin/sh\necho pip \"$@\" >> {log}\n")
    pip.chmod(0o755)
    env = {**os.environ, "DOCKER": str(fake), "PIP": str(pip), "ALIGNFLOW_WHEELHOUSE": str(tmp_path / "wheels"), "ALIGNFLOW_IMAGE_REGISTRY": "reg.example/team",
           "ALIGNFLOW_IMAGE_TAG": "9.9.9-test", "PYTHONPATH": str(ROOT)}
    for name in ("ALIGNFLOW_TRAINER_IMAGE", "ALIGNFLOW_TRAINER_CPU_IMAGE", "ALIGNFLOW_MLFLOW_IMAGE"):
        env.pop(name, None)
    out = subprocess.run(["bash", str(IMAGES / "build.sh"), "--no-push", "--cpu"], env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    if out.returncode != 0 and "not CPython 3.11" in out.stderr:
        pytest.skip(out.stderr.strip())
    assert out.returncode == 0, out.stderr
    calls = [c.removeprefix("buildx ") for c in log.read_text().splitlines() if not c.startswith("image inspect")]
    built = [c.split("--tag ")[1].split()[0] for c in calls if c.startswith("build")]
    assert built == ["reg.example/team/trainer:9.9.9-test-cpu", "reg.example/team/mlflow:9.9.9-test"]
    assert not [c for c in calls if c.startswith("push")]
    assert "Built reg.example/team/trainer:9.9.9-test-cpu in " in out.stdout
    wheel = [c for c in calls if c.startswith("pip wheel") and "torch==2.13.0" in c]
    assert wheel and "-c requirements/cpu.txt" in wheel[0]


def test_build_sh_rejects_an_unknown_option():
    out = subprocess.run(["bash", str(IMAGES / "build.sh"), "--gpu"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown option --gpu" in out.stderr
