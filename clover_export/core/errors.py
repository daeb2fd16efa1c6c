"""The one user-facing exception.

Every failure a user can cause (bad config, bad checkpoint, bad request) is a
`CloverError` whose message names the file, tensor or field; the CLI prints it
without a traceback (Polygraphy's habit).
"""


class CloverError(Exception):
    """A failure with a message meant for the user."""

    def __init__(self, component: str, message: str, note: str | None = None):
        self.component = component
        self.message = message
        self.note = note
        text = f"[{component}] {message}"
        if note:
            text += f"\n  Note: {note}"
        super().__init__(text)

    def __reduce__(self):  # pickled across processes (a build's background export) with its parts
        return (type(self), (self.component, self.message, self.note))
