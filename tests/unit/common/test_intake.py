"""The intake rules admission and the conductor share (services.common.intake)."""

import pytest

from services.common.hashing import block_hashes
from services.common.intake import hashes_for, reply_to, salvage

PROMPT = list(range(100))


def test_the_request_own_reply_subject_wins_over_the_message_reply():
    assert reply_to("perigee.gw.a.r1", "_INBOX.x") == "perigee.gw.a.r1"
    assert reply_to("", "_INBOX.x") == "_INBOX.x"
    assert reply_to("", None) == ""


def test_salvage_keeps_only_string_fields_of_a_json_object():
    assert salvage(b'{"request_id": "r", "reply_subject": "s", "bogus": 1}') == ("r", "s")
    assert salvage(b'{"request_id": 5, "reply_subject": ["s"]}') == ("", "")
    for junk in (b"", b"not json", b"[1, 2]", b"\xff\xfe"):
        assert salvage(junk) == ("", "")


def test_hashes_are_kept_when_made_with_the_block_size_and_computed_otherwise():
    mine = block_hashes(PROMPT, 32)
    assert hashes_for(PROMPT, None, 0, 32) == mine
    assert hashes_for(PROMPT, [7, 8, 9], 0, 32) == [7, 8, 9]  # given, trusted
    assert hashes_for(PROMPT, [7, 8, 9], 32, 32) == [7, 8, 9]
    assert hashes_for(PROMPT, block_hashes(PROMPT, 16), 16, 32) == mine  # other size: redone
    with pytest.raises(ValueError, match="block_hashes has 2 entries, the prompt has 3 full"):
        hashes_for(PROMPT, [7, 8], 32, 32)
