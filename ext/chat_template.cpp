#include "chat_template.h"

#include "json.h"

#include <algorithm>
#include <random>

namespace engine {

namespace {

std::string first_line(const std::string & s, size_t max = 60) {
    std::string line = s.substr(0, s.find('\n'));
    return line.size() > max ? line.substr(0, max) + "..." : line;
}

bool is_builtin_name(const std::string & name) {
    std::vector<const char *> names(64);
    int32_t n = llama_chat_builtin_templates(names.data(), names.size());
    if (n > static_cast<int32_t>(names.size())) {
        names.resize(n);
        n = llama_chat_builtin_templates(names.data(), names.size());
    }
    return std::any_of(names.begin(), names.begin() + n, [&](const char * b) { return name == b; });
}

common_json parse_json(const std::string & text, const char * what) {
    try {
        return common_json::parse(text);
    } catch (const std::exception & e) {
        fail(ErrorKind::InvalidArgument, std::string(what) + " is not valid JSON: " + e.what());
    }
}

// OpenAI's tool call ids: "call_" and 24 letters and digits.
std::string new_tool_call_id() {
    static thread_local std::mt19937_64 rng{std::random_device{}()};
    static const char alphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    std::uniform_int_distribution<size_t> pick(0, sizeof(alphabet) - 2);
    std::string id = "call_";
    for (int i = 0; i < 24; ++i) id += alphabet[pick(rng)];
    return id;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// ChatTemplate

ChatTemplate::ChatTemplate(std::shared_ptr<const Model> model, const std::string & override_src,
                           const std::string & builtin)
    : model_(std::move(model)) {
    const ModelInfo & info = model_->info();
    const std::string file = info.path.substr(info.path.find_last_of('/') + 1);
    std::string src = override_src;  // "": the model's own
    if (!src.empty()) {
        name_ = is_builtin_name(src) ? "the built-in template '" + src + "'" : "the template given (" + first_line(src) + ")";
    } else if (!info.chat_template.empty()) {
        name_ = "the chat template of " + file + " (tokenizer.chat_template)";
    } else if (!builtin.empty()) {
        src = builtin;
        name_ = "the built-in template '" + builtin + "' (" + file + " has no chat template)";
    } else {
        fail(ErrorKind::InvalidConfig, file + " has no chat template; give one (a Jinja template or a llama.cpp "
                                              "built-in name)");
    }
    // a built-in name other than chatml is rendered by llama.cpp's fixed list of renderers,
    // which know no tools; anything else is Jinja
    jinja_ = !(is_builtin_name(src) && src != "chatml");
    try {
        tmpls_ = common_chat_templates_init(model_->get(), src);
        source_ = common_chat_templates_source(tmpls_.get());
        // what the chat module refuses only when it renders (its parser generation) is
        // found now, at load time, not at the first request
        ChatInputs probe;
        probe.messages = R"([{"role": "user", "content": "hello"}])";
        render(probe);
    } catch (const std::exception & e) {
        fail(ErrorKind::InvalidConfig, name_ + " cannot be used: " + e.what());
    }
}

std::map<std::string, bool> ChatTemplate::caps() const { return common_chat_templates_get_caps(tmpls_.get()); }

ChatPrompt ChatTemplate::render(const ChatInputs & in) const {
    common_chat_templates_inputs inputs;
    inputs.use_jinja = jinja_;
    common_json tools = in.tools.empty() ? common_json::array() : parse_json(in.tools, "tools");
    if (!tools.is_array()) fail(ErrorKind::InvalidArgument, "tools must be a list");
    std::string choice = in.tool_choice;
    if (choice != "auto" && choice != "none" && choice != "required") {
        // one named function: the only tool offered, and a call to it required
        common_json named = common_json::array();
        for (const auto & t : tools) {
            if (t.is_object() && t.contains("function") && t["function"].is_object() &&
                t["function"].value("name", std::string()) == choice) {
                named.push_back(t);
            }
        }
        if (named.empty()) fail(ErrorKind::InvalidArgument, "tool_choice names '" + choice + "', which is not in tools");
        tools = named;
        choice = "required";
    }
    if (!tools.empty() && choice != "none") {
        if (!jinja_) fail(ErrorKind::InvalidArgument, name_ + " cannot render tools (a llama.cpp built-in renderer)");
        const auto caps = common_chat_templates_get_caps(tmpls_.get());
        if (!caps.at("supports_tools") && !caps.at("supports_tool_calls")) {
            // it would drop them silently, and no grammar could hold a call to a format it lacks
            fail(ErrorKind::InvalidArgument, name_ + " has no tool format: it cannot render tools or calls");
        }
    }
    ChatPrompt out;
    try {
        inputs.messages = common_chat_msgs_parse_oaicompat(parse_json(in.messages, "messages"));
        inputs.tools = common_chat_tools_parse_oaicompat(tools);
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(choice);
        inputs.parallel_tool_calls = in.parallel_tool_calls;
        inputs.add_generation_prompt = in.add_generation_prompt && !in.continue_final_message;
        inputs.continue_final_message =
            in.continue_final_message ? COMMON_CHAT_CONTINUATION_AUTO : COMMON_CHAT_CONTINUATION_NONE;
        inputs.json_schema = in.json_schema;
        inputs.reasoning_format = in.parse_reasoning ? COMMON_REASONING_FORMAT_DEEPSEEK : COMMON_REASONING_FORMAT_NONE;
        inputs.enable_thinking = in.enable_thinking;
        if (!in.template_kwargs.empty()) {
            const common_json kwargs = parse_json(in.template_kwargs, "chat_template_kwargs");
            if (!kwargs.is_object()) fail(ErrorKind::InvalidArgument, "chat_template_kwargs must be an object");
            for (const auto & [key, value] : kwargs.items()) {
                inputs.chat_template_kwargs[key] = value.dump();
                if (key == "enable_thinking" && value.is_boolean()) inputs.enable_thinking = value.get<bool>();
            }
        }
        if (in.continue_final_message && !inputs.messages.empty() && !inputs.messages.back().tool_calls.empty()) {
            fail(ErrorKind::InvalidArgument, "cannot continue an assistant message that contains tool calls");
        }
        const common_chat_params p = common_chat_templates_apply(tmpls_.get(), inputs);
        out.prompt = p.prompt;
        out.format = common_chat_format_name(p.format);
        out.supports_thinking = p.supports_thinking;
        out.parser_format = static_cast<int32_t>(p.format);
        out.parser = p.parser;
        out.stops = p.additional_stops;
        ChatGrammar & g = out.grammar;
        g.grammar = p.grammar;
        g.lazy = p.grammar_lazy;
        g.generation_prompt = p.generation_prompt;
        const llama_vocab * vocab = model_->vocab();
        for (const auto & t : p.preserved_tokens) {
            const auto ids = common_tokenize(vocab, t, false, true);
            if (ids.size() == 1) g.preserved_tokens.push_back(ids[0]);
        }
        for (const auto & t : p.grammar_triggers) {
            ChatTrigger trigger{static_cast<int32_t>(t.type), t.value, t.token};
            if (t.type == COMMON_GRAMMAR_TRIGGER_TYPE_WORD) {  // a preserved token triggers as a token
                const auto ids = common_tokenize(vocab, t.value, false, true);
                if (ids.size() == 1 && std::count(g.preserved_tokens.begin(), g.preserved_tokens.end(), ids[0])) {
                    trigger.type = COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN;
                    trigger.token = ids[0];
                }
            }
            g.triggers.push_back(std::move(trigger));
        }
        if (g.lazy && g.triggers.empty()) fail(ErrorKind::InvalidArgument, name_ + " gave a lazy grammar without triggers");
        if (!p.thinking_end_tags.empty()) {
            g.thinking_start = common_tokenize(vocab, p.thinking_start_tag, false, true);
            for (const auto & tag : p.thinking_end_tags) {
                if (!tag.empty()) g.thinking_end.push_back(common_tokenize(vocab, tag, false, true));
            }
        }
    } catch (const Error &) {
        throw;
    } catch (const std::exception & e) {
        fail(ErrorKind::InvalidArgument, std::string(e.what()));
    }
    out.parse_tool_calls = !inputs.tools.empty() && inputs.tool_choice != COMMON_CHAT_TOOL_CHOICE_NONE;
    out.parse_reasoning = in.parse_reasoning;
    out.is_continuation = in.continue_final_message;
    return out;
}

// ---------------------------------------------------------------------------------------
// ChatParser

ChatParser::ChatParser(const ChatPrompt & prompt) {
    params_.format = static_cast<common_chat_format>(prompt.parser_format);
    params_.generation_prompt = prompt.grammar.generation_prompt;
    params_.reasoning_format = prompt.parse_reasoning ? COMMON_REASONING_FORMAT_DEEPSEEK : COMMON_REASONING_FORMAT_NONE;
    params_.parse_tool_calls = prompt.parse_tool_calls;
    params_.is_continuation = prompt.is_continuation;
    try {
        if (!prompt.parser.empty()) params_.parser.load(prompt.parser);
        // a continued message: what the template already holds is not handed out again
        if (params_.is_continuation) msg_ = common_chat_parse("", true, params_);
    } catch (const std::exception & e) {
        fail(ErrorKind::InvalidArgument, std::string("cannot build the chat parser: ") + e.what());
    }
}

ChatDelta ChatParser::update(const std::string & text, bool final) {
    text_ += text;
    ChatDelta out;
    common_chat_msg m;
    std::vector<common_chat_msg_diff> diffs;
    try {
        m = common_chat_parse(text_, !final, params_);
        if (m.empty() && !final) return out;
        for (size_t i = 0; i < m.tool_calls.size(); ++i) {
            if (ids_.size() <= i) ids_.push_back(m.tool_calls[i].id.empty() ? new_tool_call_id() : m.tool_calls[i].id);
            m.tool_calls[i].id = ids_[i];
        }
        diffs = common_chat_msg_diff::compute_diffs(msg_, m);
    } catch (const std::exception &) {
        if (!final) return out;  // not parseable yet: wait for more text
        // the whole output does not follow the template's format (a weak model's attempt
        // at a call, say): the message stays what was read so far, or, when nothing was,
        // the whole text is its content
        m = msg_;
        if (m.empty()) {
            m.role = "assistant";
            m.content = text_;
        }
        diffs = common_chat_msg_diff::compute_diffs(msg_, m);
    }
    msg_ = std::move(m);
    announced_.resize(msg_.tool_calls.size(), false);
    auto add = [&](int32_t index, std::string id, std::string name, const std::string & arguments) {
        if (!out.tool_calls.empty() && out.tool_calls.back().index == index && id.empty()) {
            out.tool_calls.back().arguments += arguments;
        } else {
            out.tool_calls.push_back({index, std::move(id), std::move(name), arguments});
        }
    };
    // a call's name can still grow while its arguments have not begun: it is handed out
    // with the first fragment of its arguments, when a later call begins, or at the end
    auto announce_before = [&](size_t index) {
        for (size_t j = 0; j < index && j < msg_.tool_calls.size(); ++j) {
            if (!announced_[j] && !msg_.tool_calls[j].name.empty()) {
                add(static_cast<int32_t>(j), ids_[j], msg_.tool_calls[j].name, "");
                announced_[j] = true;
            }
        }
    };
    for (const auto & d : diffs) {
        if (d.tool_call_index == std::string::npos) {
            out.reasoning += d.reasoning_content_delta;
            out.content += d.content_delta;
            continue;
        }
        const size_t i = d.tool_call_index;
        announce_before(i);
        if (announced_[i]) {
            if (!d.tool_call_delta.arguments.empty()) add(static_cast<int32_t>(i), "", "", d.tool_call_delta.arguments);
        } else if (!d.tool_call_delta.arguments.empty() && !msg_.tool_calls[i].name.empty()) {
            add(static_cast<int32_t>(i), ids_[i], msg_.tool_calls[i].name, d.tool_call_delta.arguments);
            announced_[i] = true;
        }
    }
    if (final) announce_before(msg_.tool_calls.size());
    return out;
}

ChatMessage ChatParser::message() const {
    ChatMessage m;
    m.content = msg_.content;
    m.reasoning = msg_.reasoning_content;
    for (const auto & tc : msg_.tool_calls) m.tool_calls.push_back({tc.id, tc.name, tc.arguments});
    return m;
}

}  // namespace engine
