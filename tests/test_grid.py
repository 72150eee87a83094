"""The host's launch grids (relgen.tiles.grid): how the key pass splits a grouped-query group's heads."""

from __future__ import annotations

import pytest
import torch

from relgen.tiles import grid

CUDA = torch.device("cuda")  # a device value only: nothing runs on it
SMS = 132


@pytest.fixture
def gpu_of_132_sms(monkeypatch):
    monkeypatch.setattr(grid, "_sm_count", lambda device: SMS)


@pytest.mark.parametrize("kv_group", [2, 4, 8])
@pytest.mark.parametrize("programs", [8, 100, 1024])
def test_a_key_pass_without_dzk_runs_one_query_head_a_program(gpu_of_132_sms, kv_group, programs):
    assert grid.group_splits(0, kv_group, programs, CUDA, whole_groups=False) == kv_group


@pytest.mark.parametrize(
    ("kv_group", "programs", "parts"),
    [
        (4, 1024, 1),  # the GPU is full: the group stays in one program
        (4, 132, 1),
        (4, 100, 2),  # 200 programs fill 132 SMs
        (4, 40, 4),  # 160
        (4, 8, 4),  # never more parts than heads
        (6, 50, 3),  # only divisors of the group: 2 would leave 100 programs
        (8, 20, 8),
    ],
)
def test_whole_groups_split_only_while_the_gpu_is_short_of_programs(gpu_of_132_sms, kv_group, programs, parts):
    assert grid.group_splits(0, kv_group, programs, CUDA, whole_groups=True) == parts


@pytest.mark.parametrize("whole_groups", [False, True])
def test_a_requested_split_is_the_largest_divisor_of_the_group_up_to_it(gpu_of_132_sms, whole_groups):
    assert grid.group_splits(3, 4, 1024, CUDA, whole_groups) == 2
    assert grid.group_splits(1, 4, 8, CUDA, whole_groups) == 1
    assert grid.group_splits(16, 4, 8, CUDA, whole_groups) == 4


@pytest.mark.parametrize("whole_groups", [False, True])
def test_one_head_a_group_and_the_interpreters_two_parts(whole_groups):
    cpu = torch.device("cpu")
    assert grid.group_splits(0, 1, 8, CUDA, whole_groups) == 1
    assert [grid.group_splits(0, g, 8, cpu, whole_groups) for g in (1, 2, 4, 8)] == [1, 1, 2, 2]
