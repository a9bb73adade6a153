"""The API dialects memproxy speaks with memory: chat completions, OpenAI's Responses API, Anthropic's Messages.

Each is a ``Dialect`` (``base``): parse, a chat view for memory, the placement plan written into its own body,
and the reply read out of a body or an event stream. ``targets`` says where each dialect's requests go.
"""

from proxy.dialects.base import ChatView, Dialect, Reply, ReplyReader
from proxy.dialects.chat import CHAT
from proxy.dialects.messages import MESSAGES
from proxy.dialects.responses import RESPONSES

__all__ = ["CHAT", "MESSAGES", "RESPONSES", "ChatView", "Dialect", "Reply", "ReplyReader"]
