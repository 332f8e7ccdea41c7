"""Markdown into a QTextDocument, with code blocks set apart (fixed font, shaded, unwrapped).

Qt's own Markdown reader (GitHub dialect) does the parsing; this only restyles the blocks it marks
as code: fenced blocks carry `nonBreakableLines`, indented ones a monospace font.
"""

from __future__ import annotations

from PySide6.QtGui import QColor, QFontDatabase, QTextBlockFormat, QTextCharFormat, QTextCursor, QTextDocument


def _is_code(block) -> bool:
    if block.blockFormat().nonBreakableLines():
        return True
    font = block.charFormat().font()
    return block.charFormat().fontFixedPitch() or "mono" in font.family().lower()


def render_markdown(doc: QTextDocument, text: str, code_background: QColor) -> None:
    doc.setMarkdown(text, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
    fixed = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
    block_fmt = QTextBlockFormat()
    block_fmt.setBackground(code_background)
    block_fmt.setLeftMargin(6)
    block_fmt.setRightMargin(6)
    block_fmt.setNonBreakableLines(True)
    char_fmt = QTextCharFormat()
    char_fmt.setFont(fixed)
    cursor = QTextCursor(doc)
    cursor.beginEditBlock()
    block = doc.begin()
    while block.isValid():
        if _is_code(block):
            cursor.setPosition(block.position())
            cursor.setPosition(block.position() + max(block.length() - 1, 0), QTextCursor.MoveMode.KeepAnchor)
            cursor.mergeBlockFormat(block_fmt)
            cursor.mergeCharFormat(char_fmt)
        block = block.next()
    cursor.endEditBlock()


def code_groups(doc: QTextDocument) -> list[tuple[object, str]]:
    """(first block, text) of each code block (consecutive code lines joined), for its copy button."""
    out, first, lines = [], None, []
    block = doc.begin()
    while block.isValid():
        if _is_code(block):
            if first is None:
                first = block
            lines.append(block.text())
        elif first is not None:
            out.append((first, "\n".join(lines)))
            first, lines = None, []
        block = block.next()
    if first is not None:
        out.append((first, "\n".join(lines)))
    return out


def code_blocks(doc: QTextDocument) -> list[str]:
    """The text of each code block, for tests and 'copy code'."""
    return [text for _, text in code_groups(doc)]
