"""The HTTP front end: the OpenAI protocol, the guard (auth, limits) and the server flags.
`python -m jkv.server` starts it."""
