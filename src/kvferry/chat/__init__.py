"""``kvferry chat``: the interactive terminal client (cli.py: flags and
which server; session.py: the conversation loop; client.py: the HTTP
stream; launcher.py: a server of the chat's own). The server's chat route
is kvferry/serve/chat.py."""
