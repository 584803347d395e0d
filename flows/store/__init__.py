"""Where artifacts live: a folder or a URL, with stage locks."""
