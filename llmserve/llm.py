"""`LLM`: offline batched generation, with vLLM's interface.

    from llmserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-folder")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)
    replies = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=32))

The engine core runs in this process: offline use has no HTTP thread to protect it from.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from llmserve.chat_template import render_chat
from llmserve.config import ConfigError, EngineArgs, EngineConfig
from llmserve.engine.engine_core import EngineCore, step_pipeline
from llmserve.engine.input_processor import InputProcessor, PromptType
from llmserve.engine.output_processor import OutputProcessor, RequestFailedError
from llmserve.engine.request import SchedulerStats
from llmserve.engine.request_feed import RequestFeed
from llmserve.engine.step_log import step_timing_log
from llmserve.lora_request import LoRARequest
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer import load_tokenizer


def engine_args_from_kwargs(model: str | None, kwargs: dict) -> EngineArgs:
    unknown = set(kwargs) - EngineArgs.field_names()
    if unknown:
        raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    return EngineArgs(**kwargs) if model is None else EngineArgs(model=model, **kwargs)


class LLM:
    def __init__(self, model: str | None = None, reasoning_parser: str | None = None, **kwargs) -> None:
        """`reasoning_parser` (vLLM's option: deepseek_r1, qwen3, gpt_oss): `chat` cuts each reply into its
        thoughts and its answer (llmserve/reasoning)."""
        from llmserve.reasoning import reasoning_parser as check_parser

        if reasoning_parser is not None:
            check_parser(reasoning_parser)  # an unknown name fails here
        self.reasoning_parser = reasoning_parser
        self.config: EngineConfig = engine_args_from_kwargs(model, kwargs).create_engine_config()
        if self.config.data_parallel_size > 1:
            raise ConfigError("LLM runs one engine core in this process; data_parallel_size > 1 is served by "
                              "AsyncEngine (`llmserve serve --data-parallel-size N`)")  # fmt: skip
        self.tokenizer = load_tokenizer(self.config.model_config.tokenizer)
        self.core = EngineCore(self.config)
        self.input_processor = InputProcessor(self.config.model_config, self.tokenizer, self.core.structured)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one output per prompt, in prompt order.
        `lora_request`: the LoRA adapter every prompt runs with, or one per prompt (None: the
        base model; the engine needs `enable_lora=True`).

        Every prompt is checked before any is queued, so a bad one raises and leaves the
        engine as it was."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(params_list) != len(prompts) or len(priorities) != len(prompts) or len(loras) != len(prompts):
            raise ValueError("sampling_params, priority and lora_request must match the number of prompts")
        processed = [
            self.input_processor.process(str(next(self._counter)), prompt, p, prio, lora_request=lora)
            for prompt, p, prio, lora in zip(prompts, params_list, priorities, loras)
        ]
        self.core.wake_up()  # asleep: the weights and the KV cache come back first
        order = {p.request_id: i for i, p in enumerate(processed)}
        # queued a few steps ahead while the device runs (first come first served order only)
        in_order = len(set(priorities)) <= 1 and all(lora is None for lora in loras)
        feed = RequestFeed(processed, self.core.add_request, self.config.scheduler_config.max_num_batched_tokens,
                           in_order)  # fmt: skip
        try:
            for p in processed:
                self.output_processor.add_request(p)
            feed.start()
            return self._run(order, use_tqdm, feed)
        except BaseException:  # a failed or interrupted call leaves no request (and no KV block) behind
            for p in processed:
                self.core.abort_requests(self.output_processor.abort(p.request_id))
            raise

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        reasoning_parser: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or several (OpenAI-shaped message dicts, read
        as the OpenAI server reads them: text parts joined, earlier tool calls' arguments as
        objects), each written out by the model's chat template (with `tools`, OpenAI-shaped
        function definitions, if given); vLLM's `LLM.chat`. One output per conversation.

        With a reasoning parser (`reasoning_parser`, else the one the LLM was made with) each
        sample's `reasoning` and `content` hold its thoughts and its answer (`text` stays whole),
        and a structured-outputs constraint applies to the answer after the thoughts."""
        import copy

        from llmserve.openai.tools import conversation as read_conversation
        from llmserve.reasoning import prompt_tail
        from llmserve.reasoning import reasoning_parser as make_parser
        from llmserve.reasoning.grammar import after_thoughts

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations or not all(conversations):
            raise ValueError("chat needs at least one conversation of at least one message")
        name = reasoning_parser or self.reasoning_parser
        prompts, parsers = [], []
        for conversation in conversations:  # read as the OpenAI server reads `messages`
            ids = render_chat(
                self.tokenizer, read_conversation(conversation), add_generation_prompt, chat_template_kwargs, tools
            )
            prompts.append({"prompt_token_ids": ids})
            parsers.append(make_parser(name, prompt_tail(self.tokenizer, ids)) if name else None)
        if name is None:
            return self.generate(prompts, sampling_params, use_tqdm)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must match the number of conversations")
        constrained = []
        for p, parser in zip(params_list, parsers):
            if p.structured_outputs is not None:  # the constraint holds after the thoughts
                p = copy.copy(p)
                p.structured_outputs = after_thoughts(p.structured_outputs, parser.state)
            if parser.state == "harmony" and p.skip_special_tokens:  # gpt-oss's markers are special tokens
                p = copy.copy(p)
                p.skip_special_tokens = False
            constrained.append(p)
        outputs = self.generate(prompts, constrained, use_tqdm)
        for out, parser in zip(outputs, parsers):
            for sample in out.outputs:
                cut = parser.split(sample.text, done=True)
                sample.reasoning, sample.content = cut.reasoning or None, cut.content or None
        return outputs

    def _run(self, order: dict[str, int], use_tqdm: bool, feed: RequestFeed) -> list[RequestOutput]:
        """Step until done. The outputs of step N are detokenized, and the feed's next requests
        queued, while the device runs the next step(s); a stop string found there aborts its
        request a step or two later."""
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)

        def collect(outputs) -> None:
            processed = self.output_processor.process(outputs, only_finished=True)
            if processed.core_ids_to_abort:
                self.core.abort_requests(processed.core_ids_to_abort)
            if processed.errors:
                raise RequestFailedError(next(iter(processed.errors.values())))
            for out in processed.request_outputs:
                if out.finished and out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update(1)

        previous = None
        with step_timing_log(self.core.config.step_timing_log) as step_log:
            pipeline = step_pipeline(self.core, step_log)
            while self.core.has_unfinished() or pipeline.busy or not feed.done:
                pipeline.launch()
                feed.more()
                if previous is not None:
                    collect(previous)  # while the device runs the launched step(s)
                    previous = None
                done = pipeline.finish()
                if done is not None:
                    previous = done.outputs
        if previous is not None:
            collect(previous)
        bar.close()
        missing = [rid for rid, i in order.items() if results[i] is None]
        if missing:
            raise RequestFailedError(f"requests {missing} ended without output")
        return results  # type: ignore[return-value]

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do with one rank)."""
        self.core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Give the engine's device memory back until the next request (vLLM's sleep mode):
        level 1 keeps the weights in host memory, level 2 reads them again on waking. The
        prefix cache is emptied, except that at level 1 with KV tiers its blocks move down into
        them first (docs/kv_tiers.md)."""
        self.core.sleep(level)

    def wake_up(self) -> None:
        self.core.wake_up()

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()
