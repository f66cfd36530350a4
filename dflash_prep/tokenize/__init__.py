"""Stage 1, corpus -> dataset: read records, render chats, encode ids and loss masks, write Arrow shards."""
