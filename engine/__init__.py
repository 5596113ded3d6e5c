"""The only runtime package that imports llama_cpp: models, contexts, sampling, the step loop."""
from engine.chat import ChatTemplate, ChatTemplateError
from engine.config import EngineConfig
from engine.llama import Context, ContextConfig
from engine.model import Model, llama_cpp_version
from engine.request import ErrorKind, Event, Request
from engine.sampling import Sampler, SamplingParams
from engine.stats import ContextStats
from engine.worker import Observer, QueueFull, Worker

__all__ = ["ChatTemplate", "ChatTemplateError", "Context", "ContextConfig", "ContextStats",
           "EngineConfig", "ErrorKind", "Event", "Model", "Observer", "QueueFull", "Request",
           "Sampler", "SamplingParams", "Worker", "llama_cpp_version"]
