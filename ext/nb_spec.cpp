// engine._nb_spec: bindings only. The logic lives in executor.cpp, model.cpp, sampler.cpp,
// spec_session.cpp and step.cpp; here every native operation becomes a job for the
// runtime's native thread, and results and errors are converted on the calling thread.
#include "chat_template.h"
#include "executor.h"
#include "model.h"
#include "sampler.h"
#include "spec_session.h"
#include "step.h"

#include "log.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <sys/syscall.h>
#include <type_traits>
#include <unistd.h>

namespace nb = nanobind;
using namespace nb::literals;
using namespace engine;

namespace {

// ---------------------------------------------------------------------------------------
// llama.cpp log routing: by default only errors reach stderr (ENGINE_LLAMA_LOG=
// debug|info|warn|error|none changes that). The callback runs on the native thread and
// never touches Python; nothing of llama.cpp's reaches stdout.

std::atomic<int> g_log_level{GGML_LOG_LEVEL_ERROR};

void log_callback(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_CONT || level >= g_log_level.load()) {
        if (level != GGML_LOG_LEVEL_CONT || g_log_level.load() <= GGML_LOG_LEVEL_INFO) {
            std::fputs(text, stderr);
        }
    }
}

void init_logging() {
    const char * env = std::getenv("ENGINE_LLAMA_LOG");
    std::string v = env ? env : "error";
    int level = GGML_LOG_LEVEL_ERROR;
    if (v == "debug") level = GGML_LOG_LEVEL_DEBUG;
    else if (v == "info") level = GGML_LOG_LEVEL_INFO;
    else if (v == "warn") level = GGML_LOG_LEVEL_WARN;
    else if (v == "none") level = GGML_LOG_LEVEL_ERROR + 1;
    g_log_level = level;
    llama_log_set(log_callback, nullptr);
    common_log_set_verbosity_thold(level <= GGML_LOG_LEVEL_INFO ? LOG_DEFAULT_LLAMA : -1);
}

// ---------------------------------------------------------------------------------------
// Jobs

// Run `f` on the native thread and wait for it with the GIL released.
template <class F>
auto run_sync(Executor & ex, F && f) -> std::decay_t<decltype(f())> {
    using R = std::decay_t<decltype(f())>;
    std::shared_ptr<Ticket> t = ex.submit(
        [f = std::forward<F>(f)]() mutable -> std::any {
            if constexpr (std::is_void_v<R>) {
                f();
                return {};
            } else {
                return std::any(R(f()));
            }
        },
        /*notify=*/false);
    {
        nb::gil_scoped_release release;
        t->wait();
    }
    if (t->error) {
        std::rethrow_exception(t->error);
    }
    if constexpr (!std::is_void_v<R>) {
        return std::any_cast<R>(std::move(t->value));
    }
}

// A job submitted without waiting; async code awaits it through the runtime's wake-up fd.
struct PyTicket {
    std::shared_ptr<Ticket> ticket;
    std::function<nb::object(std::any &)> convert;

    uint64_t id() const { return ticket->id; }
    bool done() const { return ticket->is_done(); }
    void wait() const {
        nb::gil_scoped_release release;
        ticket->wait();
    }
    nb::object result() {
        wait();
        if (ticket->error) {
            std::rethrow_exception(ticket->error);
        }
        return convert(ticket->value);
    }
};

template <class F>
PyTicket run_async(Executor & ex, F && f) {
    using R = decltype(f());
    PyTicket out;
    out.ticket = ex.submit([f = std::forward<F>(f)]() mutable -> std::any { return std::any(f()); }, /*notify=*/true);
    out.convert = [](std::any & v) { return nb::cast(std::any_cast<R>(std::move(v))); };
    return out;
}

int64_t native_tid() { return static_cast<int64_t>(syscall(SYS_gettid)); }

// ---------------------------------------------------------------------------------------
// Handles: Python holds an id in the runtime's object table, never the object itself, so
// that objects are created and destroyed on the native thread only.

struct Runtime {
    std::shared_ptr<Executor> ex = std::make_shared<Executor>();
};

template <class T>
std::shared_ptr<T> lock_weak(const std::weak_ptr<T> & weak) {  // native thread
    std::shared_ptr<T> p = weak.lock();
    if (!p) fail(ErrorKind::Closed, "the object was freed (its runtime is closed)");
    return p;
}

template <class T>
struct Handle {
    using Object = T;
    std::shared_ptr<Executor> ex;
    uint64_t id = 0;
    std::weak_ptr<T> weak;  // locked on the native thread only

    Handle() = default;
    Handle(const Handle &) = delete;
    Handle & operator=(const Handle &) = delete;
    ~Handle() {
        if (ex && id) {
            Executor * e = ex.get();
            const uint64_t i = id;
            ex->post_quiet([e, i] { e->erase(i); });
        }
    }
    std::shared_ptr<T> lock() const { return lock_weak(weak); }  // native thread
    void adopt(std::shared_ptr<Executor> executor, std::shared_ptr<T> obj) {  // native thread
        ex = std::move(executor);
        weak = obj;
        id = ex->adopt(std::static_pointer_cast<void>(obj));
    }
    Executor & executor() const {
        if (!ex) fail(ErrorKind::Closed, "uninitialised handle");
        return *ex;
    }
};

// f(object) on the handle's native thread; the caller waits with the GIL released.
template <class H, class F>
auto on_native(H & h, F && f) {
    return run_sync(h.executor(), [&h, f = std::forward<F>(f)]() mutable { return f(*h.lock()); });
}

// A member function of the handle's object as a binding: `Bound<SessionHandle,
// &SpecSession::accept>::call` takes (handle, args...) and runs the method natively.
template <class H, auto M>
struct Bound;
template <class H, class T, class R, class... A, R (T::*M)(A...)>
struct Bound<H, M> {
    static std::decay_t<R> call(H & h, A... a) {
        return on_native(h, [a...](T & obj) mutable -> std::decay_t<R> { return (obj.*M)(a...); });
    }
};
template <class H, class T, class R, class... A, R (T::*M)(A...) const>
struct Bound<H, M> {
    static std::decay_t<R> call(H & h, A... a) {
        return on_native(h, [a...](T & obj) -> std::decay_t<R> { return (obj.*M)(a...); });
    }
};

struct ModelHandle : Handle<Model> {
    ModelInfo info;
};

// Where the last decode's outputs are, read without copying (valid until the next decode).
struct Outputs {
    const float * logits = nullptr;
    const float * embeddings = nullptr;
    int32_t n = 0;
};

struct ContextHandle : Handle<Context> {
    ContextParams params;
    std::shared_ptr<ModelHandle> model_ref;  // keeps the Python model object reachable
    int32_t n_vocab = 0;
    int32_t n_embd = 0;
    std::shared_ptr<Outputs> out = std::make_shared<Outputs>();
};

struct RunnerHandle : Handle<StepRunner> {};

struct ChatTemplateHandle : Handle<ChatTemplate> {
    std::string name, source;
    bool jinja = true;
    std::map<std::string, bool> caps;
};

struct SessionHandle : Handle<SpecSession> {
    SpecConfig config;
    nb::object target_ref, draft_ref;
};

std::vector<uint8_t> to_vec(const nb::bytes & b) {
    const auto * p = static_cast<const uint8_t *>(b.data());
    return std::vector<uint8_t>(p, p + b.size());
}

nb::bytes to_bytes(const std::vector<uint8_t> & v) {
    return nb::bytes(reinterpret_cast<const char *>(v.data()), v.size());
}

nb::bytes to_bytes(const std::string & s) { return nb::bytes(s.data(), s.size()); }

void translate(const std::exception_ptr & p, void *) {
    try {
        std::rethrow_exception(p);
    } catch (const Error & e) {
        nb::object errors = nb::module_::import_("engine.session.errors");
        nb::dict details;
        auto put = [&](const char * k, const std::optional<int64_t> & v) {
            if (v) details[k] = *v;
        };
        put("seq_id", e.seq_id);
        put("n_seq", e.n_seq);
        put("size", e.size);
        put("maximum", e.maximum);
        put("accepted", e.accepted);
        put("proposed", e.proposed);
        put("code", e.code);
        if (!e.reason.empty()) details["reason"] = e.reason;
        nb::object cls = errors.attr(error_kind_name(e.kind));
        nb::object exc = cls(e.what(), **details);
        PyErr_SetObject(cls.ptr(), exc.ptr());
    }
}

BatchData make_batch(const std::vector<int32_t> & tokens, const std::vector<int32_t> & pos,
                     const std::vector<int32_t> & seq, const std::vector<bool> & logits) {
    BatchData b;
    b.tokens = tokens;
    b.pos = pos;
    b.seq = seq;
    b.logits.assign(logits.begin(), logits.end());
    return b;
}

void after_decode(Outputs & o, const Context & c) {
    o.logits = c.logits();
    o.embeddings = c.embeddings();
    o.n = c.n_outputs();
}

SequenceState to_state(nb::bytes target, nb::bytes draft, nb::bytes spec) {
    return SequenceState{to_vec(target), to_vec(draft), to_vec(spec)};
}

// The sections of a checkpoint: a draft context's sequence state is never empty, so an
// empty draft part means the session has no draft context.
nb::dict state_sections(const SequenceState & s) {
    nb::dict d;
    d["target"] = to_bytes(s.target);
    if (!s.draft.empty()) d["draft"] = to_bytes(s.draft);
    d["spec"] = to_bytes(s.spec);
    return d;
}


// --- chat: templates (native thread) and output parsers (any thread) ----------------------
void bind_chat(nb::module_ & m) {
    nb::class_<ChatTrigger>(m, "ChatTrigger")
        .def(nb::init<>())
        .def_rw("type", &ChatTrigger::type)
        .def_rw("value", &ChatTrigger::value)
        .def_rw("token", &ChatTrigger::token);
    nb::class_<ChatGrammar>(m, "ChatGrammar", "What a chat template asks of the sampler (tool calls).")
        .def(nb::init<>())
        .def_rw("grammar", &ChatGrammar::grammar)
        .def_rw("lazy", &ChatGrammar::lazy)
        .def_rw("triggers", &ChatGrammar::triggers)
        .def_rw("preserved_tokens", &ChatGrammar::preserved_tokens)
        .def_rw("generation_prompt", &ChatGrammar::generation_prompt)
        .def_rw("thinking_start", &ChatGrammar::thinking_start)
        .def_rw("thinking_end", &ChatGrammar::thinking_end);
    nb::class_<ChatInputs>(m, "ChatInputs")
        .def(nb::init<>())
        .def_rw("messages", &ChatInputs::messages)
        .def_rw("tools", &ChatInputs::tools)
        .def_rw("tool_choice", &ChatInputs::tool_choice)
        .def_rw("parallel_tool_calls", &ChatInputs::parallel_tool_calls)
        .def_rw("add_generation_prompt", &ChatInputs::add_generation_prompt)
        .def_rw("continue_final_message", &ChatInputs::continue_final_message)
        .def_rw("template_kwargs", &ChatInputs::template_kwargs)
        .def_rw("json_schema", &ChatInputs::json_schema)
        .def_rw("enable_thinking", &ChatInputs::enable_thinking)
        .def_rw("parse_reasoning", &ChatInputs::parse_reasoning);
    nb::class_<ChatPrompt>(m, "ChatPrompt")
        .def_ro("prompt", &ChatPrompt::prompt)
        .def_ro("grammar", &ChatPrompt::grammar)
        .def_ro("stops", &ChatPrompt::stops)
        .def_ro("format", &ChatPrompt::format)
        .def_ro("supports_thinking", &ChatPrompt::supports_thinking)
        .def_ro("parse_tool_calls", &ChatPrompt::parse_tool_calls)
        .def_ro("parse_reasoning", &ChatPrompt::parse_reasoning)
        .def_ro("is_continuation", &ChatPrompt::is_continuation);

    nb::class_<ChatTemplateHandle>(m, "ChatTemplate", "A model's chat template, through llama.cpp's chat module.")
        .def_static("create", [](ModelHandle & model, const std::string & override_src, const std::string & builtin) {
                auto h = std::make_shared<ChatTemplateHandle>();
                auto ex = model.ex;
                run_sync(model.executor(), [ex, h_raw = h.get(), &model, override_src, builtin] {
                    auto t = std::make_shared<ChatTemplate>(model.lock(), override_src, builtin);
                    h_raw->name = t->name();
                    h_raw->source = t->source();
                    h_raw->jinja = t->jinja();
                    h_raw->caps = t->caps();
                    h_raw->adopt(ex, t);
                });
                return h;
            }, "model"_a, "override"_a = "", "builtin"_a = "")
        .def_prop_ro("name", [](const ChatTemplateHandle & h) { return h.name; })
        .def_prop_ro("source", [](const ChatTemplateHandle & h) { return h.source; })
        .def_prop_ro("jinja", [](const ChatTemplateHandle & h) { return h.jinja; })
        .def_prop_ro("caps", [](const ChatTemplateHandle & h) { return h.caps; })
        .def("render", &Bound<ChatTemplateHandle, &ChatTemplate::render>::call, "inputs"_a)
        .def("render_async", [](ChatTemplateHandle & h, const ChatInputs & in) {
                return run_async(h.executor(), [weak = h.weak, in] { return lock_weak(weak)->render(in); });
            }, "inputs"_a);

    nb::class_<ToolCallDelta>(m, "ToolCallDelta")
        .def_ro("index", &ToolCallDelta::index)
        .def_ro("id", &ToolCallDelta::id)
        .def_ro("name", &ToolCallDelta::name)
        .def_ro("arguments", &ToolCallDelta::arguments);
    nb::class_<ChatDelta>(m, "ChatDelta")
        .def_ro("reasoning", &ChatDelta::reasoning)
        .def_ro("content", &ChatDelta::content)
        .def_ro("tool_calls", &ChatDelta::tool_calls);
    nb::class_<ToolCall>(m, "ToolCall")
        .def_ro("id", &ToolCall::id)
        .def_ro("name", &ToolCall::name)
        .def_ro("arguments", &ToolCall::arguments);
    nb::class_<ChatMessage>(m, "ChatMessage")
        .def_ro("content", &ChatMessage::content)
        .def_ro("reasoning", &ChatMessage::reasoning)
        .def_ro("tool_calls", &ChatMessage::tool_calls);
    // strings in, strings out: no llama.cpp object, so it runs on the caller's thread
    nb::class_<ChatParser>(m, "ChatParser", "Reads one request's output as the template's format.")
        .def(nb::init<const ChatPrompt &>(), "prompt"_a)
        .def("update", &ChatParser::update, "text"_a, "final"_a = false, nb::call_guard<nb::gil_scoped_release>())
        .def("message", &ChatParser::message);
}

// --- the native thread and its tickets -----------------------------------------------
void bind_runtime(nb::module_ & m) {
    nb::class_<PyTicket>(m, "Ticket", "A native job in flight.")
        .def_prop_ro("id", &PyTicket::id)
        .def("done", &PyTicket::done)
        .def("wait", &PyTicket::wait)
        .def("result", &PyTicket::result, "Wait (GIL released), then return the result or raise its error.");

    nb::class_<Runtime>(m, "Runtime", "The native thread that makes every llama.cpp call.")
        .def(nb::init<>())
        .def_prop_ro("thread_id", [](const Runtime & r) { return r.ex->thread_id(); })
        .def_prop_ro("wake_fd", [](const Runtime & r) { return r.ex->wake_fd(); })
        .def_prop_ro("closed", [](const Runtime & r) { return r.ex->closed(); })
        .def("take_completed", [](Runtime & r) { return r.ex->take_completed(); })
        .def("ping", [](Runtime & r) { return run_sync(*r.ex, [] { return native_tid(); }); },
             "Run a no-op on the native thread; returns the kernel thread id it ran on.")
        .def("ping_async", [](Runtime & r) { return run_async(*r.ex, [] { return native_tid(); }); })
        .def("sleep_async", [](Runtime & r, double seconds) {
                 return run_async(*r.ex, [seconds] {
                     usleep(static_cast<useconds_t>(seconds * 1e6));
                     return native_tid();
                 });
             }, "seconds"_a)
        .def("close", [](Runtime & r) {
                 nb::gil_scoped_release release;
                 r.ex->shutdown();
             }, "Finish queued work, free every native object, join the thread. Idempotent.");
}

// --- GGUF facts, model info and loading ----------------------------------------------
void bind_model(nb::module_ & m) {
    nb::class_<GgufFacts>(m, "GgufFacts")
        .def_ro("arch", &GgufFacts::arch)
        .def_ro("block_count", &GgufFacts::block_count)
        .def_ro("n_embd", &GgufFacts::n_embd)
        .def_ro("target_layers", &GgufFacts::target_layers)
        .def_ro("target_hidden_size", &GgufFacts::target_hidden_size)
        .def_ro("mask_token_id", &GgufFacts::mask_token_id)
        .def_ro("block_size", &GgufFacts::block_size);

    nb::class_<ModelInfo>(m, "ModelInfo")
        .def_ro("path", &ModelInfo::path)
        .def_ro("arch", &ModelInfo::arch)
        .def_ro("description", &ModelInfo::description)
        .def_ro("n_vocab", &ModelInfo::n_vocab)
        .def_ro("n_embd", &ModelInfo::n_embd)
        .def_ro("n_layer", &ModelInfo::n_layer)
        .def_ro("n_layer_nextn", &ModelInfo::n_layer_nextn)
        .def_ro("n_head", &ModelInfo::n_head)
        .def_ro("n_head_kv", &ModelInfo::n_head_kv)
        .def_ro("n_ctx_train", &ModelInfo::n_ctx_train)
        .def_ro("n_params", &ModelInfo::n_params)
        .def_ro("size", &ModelInfo::size)
        .def_ro("file_size", &ModelInfo::file_size)
        .def_ro("is_recurrent", &ModelInfo::is_recurrent)
        .def_ro("is_hybrid", &ModelInfo::is_hybrid)
        .def_ro("vocab_type", &ModelInfo::vocab_type)
        .def_ro("bos", &ModelInfo::bos)
        .def_ro("eos", &ModelInfo::eos)
        .def_ro("eot", &ModelInfo::eot)
        .def_ro("add_bos", &ModelInfo::add_bos)
        .def_ro("eog_tokens", &ModelInfo::eog_tokens)
        .def_ro("chat_template", &ModelInfo::chat_template)
        .def_ro("metadata", &ModelInfo::metadata)
        .def_ro("facts", &ModelInfo::facts);

    nb::class_<ModelHandle>(m, "Model")
        .def_static("load", [](Runtime & r, const std::string & path, int32_t n_gpu_layers, bool load_mtp,
                               bool vocab_only) {
                auto h = std::make_shared<ModelHandle>();
                ModelParams mp;
                mp.n_gpu_layers = n_gpu_layers;
                mp.load_mtp = load_mtp;
                mp.vocab_only = vocab_only;
                auto ex = r.ex;
                h->info = run_sync(*ex, [ex, h_raw = h.get(), path, mp] {
                    auto model = std::make_shared<Model>(path, mp);
                    h_raw->adopt(ex, model);
                    return model->info();
                });
                return h;
            }, "runtime"_a, "path"_a, "n_gpu_layers"_a = 0, "load_mtp"_a = false, "vocab_only"_a = false)
        .def_prop_ro("info", [](const ModelHandle & h) { return h.info; })
        .def("tokenize", &Bound<ModelHandle, &Model::tokenize>::call,
             "text"_a, "add_special"_a = true, "parse_special"_a = false)
        .def("tokenize_async", [](ModelHandle & h, const std::string & text, bool add_special, bool parse_special) {
                return run_async(h.executor(), [weak = h.weak, text, add_special, parse_special] {
                    return lock_weak(weak)->tokenize(text, add_special, parse_special);
                });
            }, "text"_a, "add_special"_a = true, "parse_special"_a = false)
        .def("detokenize", [](ModelHandle & h, const std::vector<int32_t> & tokens, bool remove_special,
                              bool unparse_special) {
                return to_bytes(Bound<ModelHandle, &Model::detokenize>::call(h, tokens, remove_special, unparse_special));
            }, "tokens"_a, "remove_special"_a = false, "unparse_special"_a = false,
            "Bytes, which may end inside a multi-byte UTF-8 character.")
        .def("token_to_piece", [](ModelHandle & h, int32_t token, bool special) {
                return to_bytes(Bound<ModelHandle, &Model::token_to_piece>::call(h, token, special));
            }, "token"_a, "special"_a = false);
}

// --- context parameters, their rules, and contexts -----------------------------------
void bind_context(nb::module_ & m) {
    nb::enum_<ContextKind>(m, "ContextKind")
        .value("DEFAULT", ContextKind::Default)
        .value("MTP", ContextKind::Mtp);

    nb::class_<ContextParams>(m, "ContextParams")
        .def(nb::init<>())
        .def_rw("n_ctx", &ContextParams::n_ctx)
        .def_rw("n_batch", &ContextParams::n_batch)
        .def_rw("n_ubatch", &ContextParams::n_ubatch)
        .def_rw("n_seq", &ContextParams::n_seq)
        .def_rw("n_rs_seq", &ContextParams::n_rs_seq)
        .def_rw("n_outputs_max", &ContextParams::n_outputs_max)
        .def_rw("n_outputs_max_per_seq", &ContextParams::n_outputs_max_per_seq)
        .def_rw("n_threads", &ContextParams::n_threads)
        .def_rw("kind", &ContextParams::kind)
        .def_rw("embeddings", &ContextParams::embeddings)
        .def_rw("kv_unified", &ContextParams::kv_unified)
        .def_rw("batch_invariant", &ContextParams::batch_invariant);
    m.def("validate_context_params", &validate_context_params, "params"_a);

    // decode on the native thread; the job holds no reference to the Python handle
    auto decode = [](const std::weak_ptr<Context> & weak, const std::shared_ptr<Outputs> & out, const BatchData & b) {
        auto c = lock_weak(weak);
        const int32_t n = c->decode(b);
        after_decode(*out, *c);
        return n;
    };
    nb::class_<ContextHandle>(m, "Context")
        .def_static("create", [](std::shared_ptr<ModelHandle> model, const ContextParams & params,
                                 std::shared_ptr<ContextHandle> other) {
                auto h = std::make_shared<ContextHandle>();
                auto ex = model->ex;
                if (other && other->ex != ex) fail(ErrorKind::IncompatibleContexts, "contexts of different runtimes");
                h->params = run_sync(*ex, [ex, h_raw = h.get(), m_raw = model.get(), o_raw = other.get(), params] {
                    auto ctx = std::make_shared<Context>(m_raw->lock(), params, o_raw ? o_raw->lock() : nullptr);
                    h_raw->adopt(ex, ctx);
                    return ctx->params();
                });
                h->model_ref = model;
                h->n_vocab = model->info.n_vocab;
                h->n_embd = model->info.n_embd;
                return h;
            }, "model"_a, "params"_a, "other"_a = nullptr)
        .def_prop_ro("params", [](const ContextHandle & h) { return h.params; })
        .def_prop_ro("model", [](const ContextHandle & h) { return h.model_ref; })
        .def("decode", [decode](ContextHandle & h, const std::vector<int32_t> & tokens, const std::vector<int32_t> & pos,
                                const std::vector<int32_t> & seq, const std::vector<bool> & logits) {
                *h.out = Outputs{};
                return run_sync(h.executor(), [=, weak = h.weak, out = h.out, b = make_batch(tokens, pos, seq, logits)] {
                    return decode(weak, out, b);
                });
            }, "tokens"_a, "pos"_a, "seq"_a, "logits"_a)
        .def("decode_async", [decode](ContextHandle & h, const std::vector<int32_t> & tokens,
                                      const std::vector<int32_t> & pos, const std::vector<int32_t> & seq,
                                      const std::vector<bool> & logits) {
                *h.out = Outputs{};
                return run_async(h.executor(), [=, weak = h.weak, out = h.out, b = make_batch(tokens, pos, seq, logits)] {
                    return decode(weak, out, b);
                });
            }, "tokens"_a, "pos"_a, "seq"_a, "logits"_a)
        .def_prop_ro("logits", [](nb::handle self) {
                ContextHandle & h = nb::cast<ContextHandle &>(self);
                if (h.out->logits == nullptr) fail(ErrorKind::InvalidArgument, "no logits: the last decode requested none");
                return nb::ndarray<nb::numpy, const float, nb::ndim<2>>(
                    h.out->logits, {static_cast<size_t>(h.out->n), static_cast<size_t>(h.n_vocab)}, self);
            }, nb::rv_policy::reference_internal,
            "Logits of the last decode's outputs, (n_outputs, n_vocab), a view without copy: valid until the next decode.")
        .def_prop_ro("embeddings", [](nb::handle self) {
                ContextHandle & h = nb::cast<ContextHandle &>(self);
                if (h.out->embeddings == nullptr) fail(ErrorKind::InvalidArgument, "no embeddings: create the context with embeddings=True");
                return nb::ndarray<nb::numpy, const float, nb::ndim<2>>(
                    h.out->embeddings, {static_cast<size_t>(h.out->n), static_cast<size_t>(h.n_embd)}, self);
            }, nb::rv_policy::reference_internal,
            "Embeddings of the last decode's outputs, a view without copy: valid until the next decode.")
        .def("kv_remove", &Bound<ContextHandle, &Context::kv_remove>::call, "seq_id"_a, "p0"_a = -1, "p1"_a = -1)
        .def("seq_pos_max", &Bound<ContextHandle, &Context::seq_pos_max>::call, "seq_id"_a)
        .def("seq_pos_min", &Bound<ContextHandle, &Context::seq_pos_min>::call, "seq_id"_a)
        .def("state_seq_size", &Bound<ContextHandle, &Context::state_seq_size>::call, "seq_id"_a, "flags"_a = 0)
        .def("state_seq_get", [](ContextHandle & h, int32_t seq_id, uint32_t flags) {
                return to_bytes(Bound<ContextHandle, &Context::state_seq_get>::call(h, seq_id, flags));
            }, "seq_id"_a, "flags"_a = 0)
        .def("state_seq_set", [](ContextHandle & h, nb::bytes data, int32_t seq_id, uint32_t flags) {
                return Bound<ContextHandle, &Context::state_seq_set>::call(h, to_vec(data), seq_id, flags);
            }, "data"_a, "seq_id"_a, "flags"_a = 0);
}

// --- speculative configs and the session ---------------------------------------------
void bind_session(nb::module_ & m) {
    nb::class_<SpecConfig>(m, "SpecConfig")
        .def(nb::init<>())
        .def_rw("type", &SpecConfig::type)
        .def_rw("n_seq", &SpecConfig::n_seq)
        .def_rw("n_draft_max", &SpecConfig::n_draft_max)
        .def_rw("n_min", &SpecConfig::n_min)
        .def_rw("p_min", &SpecConfig::p_min)
        .def_rw("backend_sampling", &SpecConfig::backend_sampling)
        .def_rw("ngram_size_n", &SpecConfig::ngram_size_n)
        .def_rw("ngram_size_m", &SpecConfig::ngram_size_m)
        .def_rw("ngram_min_hits", &SpecConfig::ngram_min_hits);
    m.def("validate_spec_config", &validate_spec_config, "config"_a);
    m.def("spec_batch_error", &spec_batch_error, "config"_a, "n_batch"_a);
    m.def("spec_config_digest", &spec_config_digest, "config"_a,
          "What a speculative state is valid for: a digest of every field of the config.");
    m.def("spec_type_needs_draft_model", &spec_type_needs_draft_model, "type"_a);

    nb::class_<SpecStats>(m, "SpecStats")
        .def_ro("n_begin", &SpecStats::n_begin)
        .def_ro("n_process", &SpecStats::n_process)
        .def_ro("n_draft_calls", &SpecStats::n_draft_calls)
        .def_ro("n_drafts", &SpecStats::n_drafts)
        .def_ro("n_drafted", &SpecStats::n_drafted)
        .def_ro("n_accept_calls", &SpecStats::n_accept_calls)
        .def_ro("n_accepted", &SpecStats::n_accepted)
        .def_ro("accepted_per_pos", &SpecStats::accepted_per_pos)
        .def_ro("t_process_us", &SpecStats::t_process_us)
        .def_ro("n_caught_up", &SpecStats::n_caught_up)
        .def_ro("t_catch_up_us", &SpecStats::t_catch_up_us)
        .def_ro("t_draft_us", &SpecStats::t_draft_us)
        .def_ro("t_accept_us", &SpecStats::t_accept_us);

    using S = SessionHandle;
    nb::class_<SessionHandle>(m, "SpecSession")
        .def_static("create", [](nb::object target_obj, nb::object draft_obj, const SpecConfig & config) {
                auto & target = nb::cast<ContextHandle &>(target_obj);
                ContextHandle * draft = draft_obj.is_none() ? nullptr : &nb::cast<ContextHandle &>(draft_obj);
                validate_spec_config(config);  // on this thread: no native work needed
                auto h = std::make_shared<SessionHandle>();
                auto ex = target.ex;
                if (draft && draft->ex != ex) fail(ErrorKind::IncompatibleContexts, "contexts of different runtimes");
                run_sync(*ex, [ex, h_raw = h.get(), t = &target, d = draft, config] {
                    auto s = std::make_shared<SpecSession>(t->lock(), d ? d->lock() : nullptr, config);
                    h_raw->adopt(ex, s);
                });
                h->config = config;
                h->target_ref = target_obj;
                h->draft_ref = draft_obj;
                return h;
            }, "target"_a, "draft"_a.none(), "config"_a)
        .def_prop_ro("config", [](const S & h) { return h.config; })
        .def_prop_ro("target_context", [](const S & h) { return h.target_ref; })
        .def_prop_ro("draft_context", [](const S & h) { return h.draft_ref; })
        .def("need_embd", &Bound<S, &SpecSession::need_embd>::call)
        .def("need_embd_pre_norm", &Bound<S, &SpecSession::need_embd_pre_norm>::call)
        .def("drafter_sync", &Bound<S, &SpecSession::drafter_sync>::call)
        .def("can_shadow", &Bound<S, &SpecSession::can_shadow>::call)
        .def("decode_target", [](S & h, const std::vector<int32_t> & tokens, const std::vector<int32_t> & pos,
                                 const std::vector<int32_t> & seq, const std::vector<bool> & logits, bool process) {
                BatchData b = make_batch(tokens, pos, seq, logits);
                ContextHandle & t = nb::cast<ContextHandle &>(h.target_ref);
                *t.out = Outputs{};
                on_native(h, [out = t.out, b, process](SpecSession & s) {
                    s.decode_target(b);
                    after_decode(*out, *s.target());
                    if (process) s.process(b);
                });
            }, "tokens"_a, "pos"_a, "seq"_a, "logits"_a, "process"_a)
        .def("process", [](S & h, const std::vector<int32_t> & tokens, const std::vector<int32_t> & pos,
                           const std::vector<int32_t> & seq, const std::vector<bool> & logits) {
                on_native(h, [b = make_batch(tokens, pos, seq, logits)](SpecSession & s) { s.process(b); });
            }, "tokens"_a, "pos"_a, "seq"_a, "logits"_a)
        .def("begin", &Bound<S, &SpecSession::begin>::call, "seq_id"_a, "prompt"_a)
        .def("draft", &Bound<S, &SpecSession::draft>::call, "seq_id"_a, "n_past"_a, "id_last"_a)
        .def("draft_many", [](S & h, const std::vector<std::vector<int32_t>> & requests) {
                std::vector<DraftRequest> rs;
                for (const auto & r : requests) {
                    if (r.size() != 3 && r.size() != 4) fail(ErrorKind::InvalidArgument, "draft request must be (seq_id, n_past, id_last[, n_max])");
                    rs.push_back({r[0], r[1], r[2], r.size() == 4 ? r[3] : -1});
                }
                return Bound<S, &SpecSession::draft_many>::call(h, rs);
            }, "requests"_a)
        .def("accept", &Bound<S, &SpecSession::accept>::call, "seq_id"_a, "n_accepted"_a)
        .def("is_quiescent", &Bound<S, &SpecSession::is_quiescent>::call)
        .def("pending", &Bound<S, &SpecSession::pending>::call, "seq_id"_a)
        .def("print_stats", &Bound<S, &SpecSession::print_stats>::call)
        .def("stats", &Bound<S, &SpecSession::stats>::call)
        .def("history", [](S & h, int32_t seq_id) {
                return on_native(h, [seq_id](SpecSession & s) {
                    s.check_seq(seq_id);
                    return s.history(seq_id);
                });
            }, "seq_id"_a)
        .def("speculative_state", [](S & h, int32_t seq_id) {
                return to_bytes(Bound<S, &SpecSession::speculative_state>::call(h, seq_id));
            }, "seq_id"_a)
        .def("restore_speculative_state", [](S & h, int32_t seq_id, nb::bytes state) {
                Bound<S, &SpecSession::restore_speculative_state>::call(h, seq_id, to_vec(state));
            }, "seq_id"_a, "state"_a)
        .def("capture_sequence", [](S & h, int32_t seq_id) {
                return state_sections(Bound<S, &SpecSession::capture_sequence>::call(h, seq_id));
            }, "seq_id"_a, "Target, draft and speculative sections of one sequence, at a quiescent point.")
        .def("restore_sequence", [](S & h, int32_t seq_id, nb::bytes target, nb::bytes draft, nb::bytes spec) {
                Bound<S, &SpecSession::restore_sequence>::call(h, seq_id, to_state(target, draft, spec));
            }, "seq_id"_a, "target"_a, "draft"_a, "spec"_a)
        .def("clear_target_kv", &Bound<S, &SpecSession::clear_target_kv>::call,
             "seq_id"_a = -1, "p0"_a = -1, "p1"_a = -1)
        .def("clear_draft_kv", &Bound<S, &SpecSession::clear_draft_kv>::call,
             "seq_id"_a = -1, "p0"_a = -1, "p1"_a = -1);
}

// --- sampler parameters, step plans and results, the step runner ---------------------
void bind_step(nb::module_ & m) {
    nb::class_<SamplerParams>(m, "SamplerParams")
        .def(nb::init<>())
        .def_rw("temperature", &SamplerParams::temperature)
        .def_rw("top_k", &SamplerParams::top_k)
        .def_rw("top_p", &SamplerParams::top_p)
        .def_rw("min_p", &SamplerParams::min_p)
        .def_rw("seed", &SamplerParams::seed)
        .def_rw("penalty_last_n", &SamplerParams::penalty_last_n)
        .def_rw("repetition_penalty", &SamplerParams::repetition_penalty)
        .def_rw("presence_penalty", &SamplerParams::presence_penalty)
        .def_rw("frequency_penalty", &SamplerParams::frequency_penalty)
        .def_rw("ignore_eos", &SamplerParams::ignore_eos)
        .def_rw("grammar", &SamplerParams::grammar)
        .def_rw("json_schema", &SamplerParams::json_schema)
        .def_rw("logit_bias", &SamplerParams::logit_bias)
        .def_rw("n_logprobs", &SamplerParams::n_logprobs)
        .def_rw("min_tokens", &SamplerParams::min_tokens)
        .def_rw("min_tokens_suppress", &SamplerParams::min_tokens_suppress)
        .def_rw("chat", &SamplerParams::chat)
        .def_rw("special", &SamplerParams::special);
    m.attr("MAX_LOGPROBS") = MAX_LOGPROBS;
    m.def("validate_sampler_params", &validate_sampler_params, "params"_a);

    nb::class_<StepPlan>(m, "StepPlan", "What one engine step does; filled by the scheduler.")
        .def(nb::init<>())
        .def_rw("output_align", &StepPlan::output_align)
        .def_rw("align_from", &StepPlan::align_from)
        .def_rw("sync_drafter", &StepPlan::sync_drafter)
        .def("settle", [](StepPlan & p, int32_t seq, int32_t n_accepted) { p.settles.push_back({seq, n_accepted}); },
             "seq"_a, "n_accepted"_a)
        .def("capture", [](StepPlan & p, int32_t seq) { p.captures.push_back(seq); }, "seq"_a)
        .def("clear", [](StepPlan & p, int32_t seq) { p.clears.push_back(seq); }, "seq"_a)
        .def("park", [](StepPlan & p, int32_t seq, uint64_t key) { p.parks.push_back({seq, key}); },
             "seq"_a, "key"_a)
        .def("unpark", [](StepPlan & p, int32_t seq, uint64_t key) { p.unparks.push_back({seq, key}); },
             "seq"_a, "key"_a)
        .def("drop_parked", [](StepPlan & p, uint64_t key) { p.drops.push_back(key); }, "key"_a)
        .def("reuse", [](StepPlan & p, int32_t seq, std::vector<int32_t> prefix) {
                p.reuses.push_back({seq, std::move(prefix)});
            }, "seq"_a, "prefix"_a)
        .def("restore", [](StepPlan & p, int32_t seq, nb::bytes target, nb::bytes draft, nb::bytes spec) {
                p.restores.push_back({seq, to_state(target, draft, spec)});
            }, "seq"_a, "target"_a, "draft"_a, "spec"_a)
        .def("configure", [](StepPlan & p, int32_t seq, const SamplerParams & params,
                             std::vector<int32_t> replay_prompt, std::vector<int32_t> replay_generated) {
                p.configures.push_back({seq, params, std::move(replay_prompt), std::move(replay_generated)});
            }, "seq"_a, "params"_a, "replay_prompt"_a = std::vector<int32_t>{},
            "replay_generated"_a = std::vector<int32_t>{})
        .def("work", [](StepPlan & p, int32_t seq, std::vector<int32_t> tokens, int32_t pos0, bool sample,
                        int32_t n_draft, bool begin, int32_t max_draft, int32_t shadow) {
                p.work.push_back(
                    {seq, std::move(tokens), pos0, sample, n_draft, std::max(max_draft, n_draft), begin, shadow});
            }, "seq"_a, "tokens"_a, "pos0"_a, "sample"_a, "n_draft"_a = 0, "begin"_a = false, "max_draft"_a = 0,
            "shadow"_a = 0);

    nb::class_<StepOutput>(m, "StepOutput")
        .def_ro("seq", &StepOutput::seq)
        .def_ro("tokens", &StepOutput::tokens)
        .def_prop_ro("pieces", [](const StepOutput & o) {
            nb::list out;
            for (const auto & p : o.pieces) out.append(to_bytes(p));
            return out;
        })
        .def_ro("drafted", &StepOutput::drafted)
        .def_ro("produced", &StepOutput::produced)
        .def_ro("accepted", &StepOutput::accepted)
        .def_ro("in_sync", &StepOutput::in_sync)
        .def_ro("shadow", &StepOutput::shadow)
        .def_prop_ro("logprobs", [](const StepOutput & o) {  // [(logprob, [(token, logprob, bytes)...])]
            nb::list out;
            for (const TokenLogprobs & lp : o.logprobs) {
                nb::list top;
                for (const Candidate & c : lp.top) top.append(nb::make_tuple(c.token, c.logprob, to_bytes(c.piece)));
                out.append(nb::make_tuple(lp.logprob, top));
            }
            return out;
        });
    nb::class_<StepCapture>(m, "StepCapture")
        .def_ro("seq", &StepCapture::seq)
        .def_prop_ro("sections", [](const StepCapture & c) { return state_sections(c.state); });
    nb::class_<StepError>(m, "StepError")
        .def_ro("seq", &StepError::seq)
        .def_ro("kind", &StepError::kind)
        .def_ro("message", &StepError::message);
    nb::class_<StepResult>(m, "StepResult")
        .def_ro("outputs", &StepResult::outputs)
        .def_ro("captures", &StepResult::captures)
        .def_ro("errors", &StepResult::errors)
        .def_ro("n_decode_calls", &StepResult::n_decode_calls)
        .def_ro("n_draft_calls", &StepResult::n_draft_calls)
        .def_ro("n_batch_tokens", &StepResult::n_batch_tokens)
        .def_ro("n_isolated_failures", &StepResult::n_isolated_failures)
        .def_ro("draft_error", &StepResult::draft_error)
        .def_ro("t_draft_us", &StepResult::t_draft_us)
        .def_ro("t_decode_us", &StepResult::t_decode_us)
        .def_ro("t_process_us", &StepResult::t_process_us)
        .def_ro("t_catch_up_us", &StepResult::t_catch_up_us)
        .def_ro("n_sync_tokens", &StepResult::n_sync_tokens)
        .def_ro("t_total_us", &StepResult::t_total_us);

    nb::class_<RunnerHandle>(m, "StepRunner", "Executes engine steps over a speculative session.")
        .def_static("create", [](SessionHandle & session) {
                auto h = std::make_shared<RunnerHandle>();
                auto ex = session.ex;
                run_sync(*ex, [ex, h_raw = h.get(), &session] {
                    h_raw->adopt(ex, std::make_shared<StepRunner>(session.lock()));
                });
                return h;
            }, "session"_a)
        .def("step_async", [](RunnerHandle & h, const StepPlan & plan) {
                return run_async(h.executor(), [weak = h.weak, plan] { return lock_weak(weak)->run(plan); });
            }, "plan"_a);
}

}  // namespace

NB_MODULE(_nb_spec, m) {
    m.doc() = "Native core of the engine: one thread owning every llama.cpp object.";
    llama_backend_init();
    init_logging();
    nb::register_exception_translator(translate);

    m.attr("STATE_SEQ_FLAGS_NONE") = LLAMA_STATE_SEQ_FLAGS_NONE;
    m.attr("STATE_SEQ_FLAGS_PARTIAL_ONLY") = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY;
    m.attr("SPEC_TYPES") = nb::tuple(nb::cast(spec_types()));
    m.def("system_info", [] { return std::string(llama_print_system_info()); });
    // every native error kind through the real translator, for the tests of the hierarchy
    // (some kinds wrap upstream exceptions no input reaches: Begin, Accept, NotQuiescent)
    m.def("_raise_error_kind", [](int kind) {
        if (kind < 0 || kind > static_cast<int>(ErrorKind::Closed)) fail(ErrorKind::InvalidArgument, "no such error kind");
        Error e(static_cast<ErrorKind>(kind), std::string("raised for a test: ") + error_kind_name(static_cast<ErrorKind>(kind)));
        throw e;
    }, "kind"_a);

    bind_runtime(m);
    bind_model(m);
    bind_context(m);
    bind_session(m);
    bind_chat(m);  // (before the step: sampler parameters carry a chat grammar)
    bind_step(m);
}
