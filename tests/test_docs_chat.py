"""docs/chat.md's commands run as written (tests/doc_commands.py): a slow docs page, in a file of its own so that
`pytest --dist loadfile` runs it beside tests/test_docs.py's pages instead of after them."""

from doc_commands import DOCS, run_page_commands


def test_chat_page_commands_run_as_written(tmp_path, corpus, cache_dir):
    run_page_commands(DOCS / "chat.md", tmp_path, corpus, cache_dir)
