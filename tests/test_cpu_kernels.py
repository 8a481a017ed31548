"""Where the CPU kernels' build is cached (layers/cpu_kernels.py); the kernels themselves are tested
through their ops (test_quantized.py, test_cpu_attention.py, ...)."""

from __future__ import annotations

import shutil

from tokenmill.layers import cpu_kernels


def test_a_build_is_keyed_by_its_sources_and_their_place(tmp_path):
    sources, headers = cpu_kernels.SOURCES, cpu_kernels.HEADERS
    here = cpu_kernels._build_fingerprint(sources, headers)
    assert here == cpu_kernels._build_fingerprint(sources, headers)
    copy = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.CSRC, copy)

    def moved(paths):
        return [copy / path.name for path in paths]

    elsewhere = cpu_kernels._build_fingerprint(moved(sources), moved(headers))
    assert elsewhere != here  # another checkout: a build directory of its own, not a rebuild over this one
    header = copy / headers[0].name
    header.write_text(header.read_text() + "\n// changed\n")
    assert cpu_kernels._build_fingerprint(moved(sources), moved(headers)) != elsewhere  # a header is part of it
