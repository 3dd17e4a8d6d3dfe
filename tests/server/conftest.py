"""Server test fixtures."""

import pytest
import support
from live_server import real_server

from backfit.server.chat_format import ChatEncoder
from backfit.synthetic import write_small_tokenizer


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """The DSV4 encoder over the 512-id byte-level test tokenizer."""
    d = tmp_path_factory.mktemp("tok")
    write_small_tokenizer(d, 512)
    return ChatEncoder.from_file(d)


@pytest.fixture(scope="module")
def real(tiny_converted):
    """A live server on the real tiny engine (int8, tp 1, CPU), one per test module."""
    with support.one_thread():
        srv = real_server(tiny_converted(1, "int8"))
        yield srv
        srv.stop()
