"""Helpers for the GUI tests: drive the window the way a user would."""

REPLY_TIMEOUT_MS = 120_000  # generous: the test machine may be shared


def set_chat(window, **settings):
    """Change the current chat's settings the way the settings dialog does."""
    chat = window.store.chat(window.conv.chat_id)
    window.apply_chat_settings({**chat.settings, **settings})


def send_and_wait(qtbot, window, text, timeout=REPLY_TIMEOUT_MS):
    """Type and send a message; return the finished reply's result fields."""
    window.composer.edit.setPlainText(text)
    with qtbot.waitSignal(window.conv.reply_finished, timeout=timeout) as blocker:
        window.composer.send_btn.click()
    status, result = blocker.args
    assert status == "done", result
    return result
