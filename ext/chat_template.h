// Chat through llama.cpp's chat module (common/chat.*): the GGUF's own Jinja template
// renders messages and tools, and the template's parser reads reasoning and tool calls
// back out of the generated text.
//
// ChatTemplate is created and used on the native thread like every object that holds a
// llama.cpp model pointer. ChatParser holds no llama.cpp object (it parses strings with a
// parser the template generated), so each request's parser runs on its consumer's thread.
#pragma once

#include "model.h"
#include "sampler.h"

#include "chat.h"  // llama.cpp common/chat.h

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace engine {

// What one chat request asks the template for. JSON arrives as text (OpenAI's shapes).
struct ChatInputs {
    std::string messages = "[]";  // JSON array of OpenAI chat messages
    std::string tools;            // JSON array of {"type": "function", "function": {...}}, or ""
    std::string tool_choice = "auto";  // auto | none | required | the name of one tool
    bool parallel_tool_calls = false;
    bool add_generation_prompt = true;
    bool continue_final_message = false;
    std::string template_kwargs;  // JSON object of extra template variables, or ""
    std::string json_schema;      // constrain the answer's content to this schema, or ""
    bool enable_thinking = true;
    bool parse_reasoning = true;  // false: the thinking stays in the content
};

// One rendered chat request.
struct ChatPrompt {
    std::string prompt;
    ChatGrammar grammar;
    std::vector<std::string> stops;  // stop strings the template adds
    std::string format;              // the parser format's name
    bool supports_thinking = false;
    bool parse_tool_calls = false;
    // how to parse the output
    int32_t parser_format = 0;
    std::string parser;  // the serialised PEG parser (empty: content only)
    bool parse_reasoning = false;
    bool is_continuation = false;
};

class ChatTemplate {
public:
    // `override_src`: a Jinja template, or a llama.cpp built-in template's name, instead of
    // the model's own; "" takes the model's (and a built-in by architecture when it has
    // none). InvalidConfig naming the template when the chat module cannot parse it.
    ChatTemplate(std::shared_ptr<const Model> model, const std::string & override_src, const std::string & builtin);

    ChatPrompt render(const ChatInputs & in) const;
    const std::string & source() const { return source_; }
    const std::string & name() const { return name_; }
    bool jinja() const { return jinja_; }
    std::map<std::string, bool> caps() const;

private:
    std::shared_ptr<const Model> model_;
    common_chat_templates_ptr tmpls_;
    std::string source_, name_;
    bool jinja_ = true;
};

// A tool call as OpenAI streams it: the first delta of a call carries its id and name,
// later ones fragments of its arguments.
struct ToolCallDelta {
    int32_t index = 0;
    std::string id, name, arguments;
};

struct ChatDelta {
    std::string reasoning, content;
    std::vector<ToolCallDelta> tool_calls;
};

struct ToolCall {
    std::string id, name, arguments;
};

struct ChatMessage {
    std::string content, reasoning;
    std::vector<ToolCall> tool_calls;
};

// Reads one request's output as it grows. `update` takes the new text and returns what it
// adds to the message; a tool call's name is handed out once it is complete (with its
// arguments' first fragment, or at the end). InvalidArgument when the final text does not
// parse.
class ChatParser {
public:
    explicit ChatParser(const ChatPrompt & prompt);
    ChatDelta update(const std::string & text, bool final);
    ChatMessage message() const;

private:
    common_chat_parser_params params_;
    std::string text_;
    common_chat_msg msg_;
    std::vector<std::string> ids_;  // tool call ids, by index
    std::vector<bool> announced_;   // a call's id and name were handed out
};

}  // namespace engine
