"""The reuse benchmark's prompt construction and its cached-ratio bound (no engines)."""

from perigee.bench.reuse import BLOCK, PROMPT_TOKENS, ideal_ratio, ttft_prompts
from services.common.hashing import block_hashes


def test_hit90_prompt_shares_90_percent_and_115_full_blocks():
    (cold, hit), (cold2, _) = ttft_prompts(2)
    assert len(cold) == len(hit) == PROMPT_TOKENS
    assert hit[:3686] == cold[:3686] and hit[3686] != cold[3686]
    shared = 0
    for a, b in zip(block_hashes(cold, BLOCK), block_hashes(hit, BLOCK), strict=True):
        if a != b:
            break
        shared += 1
    assert shared == 115  # 3680 tokens cached of 4096
    assert cold2[:BLOCK] != cold[:BLOCK]  # pairs share nothing with each other
    assert ttft_prompts(2) == [(cold, hit), (cold2, _)]  # deterministic


def test_ideal_ratio_counts_the_longest_previously_seen_prefix():
    a = list(range(3, 3 + 64))  # 2 blocks
    b = a[:32] + list(range(500, 532))  # shares 1 block with a
    assert ideal_ratio([a]) == 0
    assert ideal_ratio([a, b]) == 32 / 128
    assert ideal_ratio([a, a + [7]]) == 64 / 129
