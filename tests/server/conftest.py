"""Server test fixtures."""

import pytest

from backfit.server.chat_format import ChatEncoder
from backfit.synthetic import write_small_tokenizer


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """The DSV4 encoder over the 512-id byte-level test tokenizer."""
    d = tmp_path_factory.mktemp("tok")
    write_small_tokenizer(d, 512)
    return ChatEncoder.from_file(d)
