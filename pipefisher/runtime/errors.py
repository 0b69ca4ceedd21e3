"""Error text helpers shared by the runtime."""


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for one-line reports."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
