"""Stage 0, a corpus to work on: reproducible synthetic chats whose token lengths follow a named profile."""
