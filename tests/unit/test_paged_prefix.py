"""The shadow of a paged prefix cache (what vLLM will reuse): whole blocks, never a prompt's last token,
shared blocks counted once, least recently used sequences evicted within the engine's block count."""

from __future__ import annotations

from modeswitch.engines.vllm.paged_prefix import PagedPrefixShadow


def test_matches_are_whole_blocks_short_of_the_prompts_last_token():
    shadow = PagedPrefixShadow(block_size=4, capacity_blocks=10)
    shadow.record(list(range(11)))  # blocks 0-3, 4-7 are full; 8-10 is not cached
    assert shadow.match(list(range(11))) == 8
    assert shadow.match(list(range(8)) + [99]) == 8
    assert shadow.match(list(range(8))) == 4  # all 8 held, but the last token must be computed
    assert shadow.match(list(range(6)) + [99, 98, 97]) == 4
    assert shadow.match([99] + list(range(10))) == 0
    assert shadow.match([1]) == 0 and shadow.match([]) == 0
    shadow.record([1, 2, 3])  # less than a block: nothing cached
    assert shadow.stats() == {"shadow_blocks": 2, "shadow_sequences": 1}


def test_shared_blocks_count_once_and_the_least_recently_used_sequence_goes_first():
    shadow = PagedPrefixShadow(block_size=2, capacity_blocks=5)
    system = [7, 7, 8, 8]
    shadow.record(system + [1, 1])
    shadow.record(system + [2, 2])
    assert shadow.stats()["shadow_blocks"] == 4  # the two system blocks are held once
    shadow.record(system + [1, 1])  # used again: [2, 2] is now the oldest
    shadow.record([5, 5, 6, 6])  # 6 blocks > 5: the oldest sequence goes, its shared blocks stay
    assert shadow.match(system + [2, 2, 0]) == 4
    assert shadow.match(system + [1, 1, 0]) == 6
    assert shadow.match([5, 5, 6, 6, 0]) == 4
    assert shadow.stats()["shadow_blocks"] == 5
