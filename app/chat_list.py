"""The chat list: search box, chats newest first, new / rename / delete."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QHBoxLayout, QInputDialog, QLineEdit, QListWidget, QListWidgetItem, QMenu,
                               QMessageBox, QPushButton, QVBoxLayout, QWidget)

from app.db import ChatStore


def _when(ts: float) -> str:
    return time.strftime("%H:%M" if time.time() - ts < 86400 else "%d %b", time.localtime(ts))


class ChatList(QWidget):
    chat_selected = Signal(str)  # chat id ("" when none is left)
    chat_deleted = Signal(str)
    chat_renamed = Signal(str)

    def __init__(self, store: ChatStore, parent=None):
        super().__init__(parent)
        self.store = store
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.new_btn = QPushButton("+ New chat")
        self.new_btn.clicked.connect(self.new_chat)
        lay.addWidget(self.new_btn)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats…")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(lambda _: self.reload())
        lay.addWidget(self.search)
        self.list = QListWidget()
        self.list.setWordWrap(True)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.currentItemChanged.connect(self._current_changed)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.itemDoubleClicked.connect(lambda item: self.rename(item.data(Qt.ItemDataRole.UserRole)))
        lay.addWidget(self.list, 1)
        row = QHBoxLayout()
        self.rename_btn = QPushButton("Rename")
        self.rename_btn.clicked.connect(lambda: self.rename(self.current_id()))
        self.delete_btn = QPushButton("Delete")
        self.delete_btn.clicked.connect(lambda: self.delete(self.current_id()))
        row.addWidget(self.rename_btn)
        row.addWidget(self.delete_btn)
        lay.addLayout(row)
        self.confirm_delete = True  # tests switch the confirmation dialog off
        self.reload()

    def current_id(self) -> str:
        item = self.list.currentItem()
        return item.data(Qt.ItemDataRole.UserRole) if item else ""

    def reload(self, select: str | None = None) -> None:
        keep = select if select is not None else self.current_id()
        self.list.blockSignals(True)
        self.list.clear()
        for chat in self.store.chats(self.search.text().strip()):
            item = QListWidgetItem(f"{chat.title}\n{_when(chat.updated)}")
            item.setData(Qt.ItemDataRole.UserRole, chat.id)
            item.setToolTip(chat.title)
            self.list.addItem(item)
            if chat.id == keep:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        has = self.list.currentItem() is not None
        self.rename_btn.setEnabled(has)
        self.delete_btn.setEnabled(has)

    def select(self, chat_id: str) -> None:
        if self.current_id() == chat_id:
            return
        if self.search.text():
            self.search.blockSignals(True)
            self.search.clear()
            self.search.blockSignals(False)
        self.reload(select=chat_id)
        self.chat_selected.emit(chat_id)

    def _current_changed(self, item, _prev) -> None:
        self.rename_btn.setEnabled(item is not None)
        self.delete_btn.setEnabled(item is not None)
        if item is not None:
            self.chat_selected.emit(item.data(Qt.ItemDataRole.UserRole))

    def new_chat(self) -> str:
        """Open an untouched chat: the one already waiting (no messages, not renamed) or a new one, so
        pressing New chat twice does not leave a trail of empty chats."""
        waiting = self.store.untouched_chat()
        chat = waiting or self.store.create_chat(settings=self.store.setting("chat_defaults", None))
        self.select(chat.id)
        return chat.id

    def rename(self, chat_id: str, title: str | None = None) -> None:
        chat = self.store.chat(chat_id) if chat_id else None
        if chat is None:
            return
        if title is None:
            title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=chat.title)
            if not ok:
                return
        self.store.rename_chat(chat_id, title)
        self.reload()
        self.chat_renamed.emit(chat_id)

    def delete(self, chat_id: str) -> None:
        chat = self.store.chat(chat_id) if chat_id else None
        if chat is None:
            return
        if self.confirm_delete and QMessageBox.question(
                self, "Delete chat", f"Delete “{chat.title}” and all its messages? This cannot be undone.") \
                != QMessageBox.StandardButton.Yes:
            return
        row = self.list.currentRow()
        self.store.delete_chat(chat_id)
        self.chat_deleted.emit(chat_id)
        self.reload()
        if self.list.count():
            self.list.setCurrentRow(min(row, self.list.count() - 1))
        else:
            self.chat_selected.emit("")

    def _menu(self, pos) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        cid = item.data(Qt.ItemDataRole.UserRole)
        m = QMenu(self)
        m.addAction("Rename…", lambda: self.rename(cid))
        m.addAction("Delete…", lambda: self.delete(cid))
        m.exec(self.list.mapToGlobal(pos))
